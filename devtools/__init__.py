"""Development tools, never imported by the nodes: the benchmark, the demo, the headless ComfyUI server
client the tests and the demo run graphs through, and the official FLUX.2 [dev] graph."""
