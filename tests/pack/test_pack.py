"""The pack as a package: installed, beside the libraries it could shadow, and loaded by the real host."""

import pathlib
import re
import subprocess
import sys

import pytest


def test_tokenizers_library_is_not_shadowed_by_the_pack():
    code = (
        "import comfyui_flux2dev.tokenizers as pack_tok, comfyui_flux2dev.loaders.models.variants, tokenizers;"
        "assert hasattr(tokenizers, 'Tokenizer'), tokenizers.__file__;"
        "assert pack_tok.__name__ == 'comfyui_flux2dev.tokenizers';"
        "assert 'site-packages' in tokenizers.__file__, tokenizers.__file__;"
        "print(tokenizers.__file__)"
    )
    # A fresh process, as a user's ComfyUI would be: nothing else imported first.
    out = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_the_command_line_entry_is_installed():
    out = subprocess.run([sys.executable, "-P", "-m", "comfyui_flux2dev.cli", "--help"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "tokenize" in out.stdout and "inspect" in out.stdout
    assert "tiny" not in out.stdout and "bench" not in out.stdout, "the user's command has user verbs only"


@pytest.mark.server
def test_the_server_loads_the_pack_and_lists_its_nodes(comfy_server):
    from comfyui_flux2dev.loaders.models.node_titles import NODES

    PACK_NODES = set(NODES)
    info = comfy_server.get("/object_info")
    assert PACK_NODES <= set(info), sorted(PACK_NODES - set(info))
    assert {name for name in info if name.startswith("Flux2Dev")} == PACK_NODES
    assert "EmptyFlux2LatentImage" in info  # the host's own FLUX.2 nodes sit beside the pack's


def test_requirements_txt_lists_exactly_the_pyproject_dependencies():
    import pathlib

    import tomllib

    root = pathlib.Path(__file__).resolve().parents[2]
    declared = tomllib.loads((root / "pyproject.toml").read_text())["project"]["dependencies"]
    listed = [line.strip() for line in (root / "requirements.txt").read_text().splitlines()]
    assert [line for line in listed if line and not line.startswith("#")] == declared


@pytest.mark.server
@pytest.mark.one_host  # the README's demo runs on the host `bash tests/run` sets up; the graph runs on every host
def test_the_demo_writes_an_image_every_time(tmp_path):
    """The README's demo command runs the dev tools' demo: its own headless server, the pack's three loaders. As
    the README runs it: from a folder of the user's, writing into the default (relative) folder there; and again,
    as a user does, with ComfyUI started from another temporary folder (the pack's modules named by another path)
    and the kernels' machine code the first run cached."""
    from PIL import Image

    for run in range(2):
        (tmp_path / "demo-out" / "flux2dev-demo.png").unlink(missing_ok=True)
        out = subprocess.run([sys.executable, "-P", "-m", "comfyui_flux2dev.devtools", "demo"], cwd=tmp_path,
                             capture_output=True, text=True)
        assert out.returncode == 0, f"run {run + 1}: {out.stderr[-4000:]}"
        image = Image.open(tmp_path / "demo-out" / "flux2dev-demo.png")
        assert image.size == (256, 256) and image.mode == "RGB"


def test_the_wheel_ships_every_module_of_the_pack_and_no_dev_tool(tmp_path):
    """A wheel built from pyproject holds the pack's modules (all of them but devtools/) and nothing else of
    the clone: no dev tool, no test."""
    import pathlib
    import shutil
    import zipfile

    root = pathlib.Path(__file__).resolve().parents[2]
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=root,
                            capture_output=True, text=True, check=True).stdout.splitlines()
    source = tmp_path / "source"
    for name in listed:
        if (root / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(root / name, source / name)
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                            "-w", str(tmp_path / "dist"), str(source)], capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    shipped = {n.removeprefix("comfyui_flux2dev/") for n in zipfile.ZipFile(wheel).namelist() if n.endswith(".py")}
    pack = {n for n in listed if n.endswith(".py") and n.split("/")[0] not in ("devtools", "tests")}
    assert shipped == pack


def _anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_relative_link_in_the_readme_and_docs_points_at_a_file_and_heading_that_exist():
    root = pathlib.Path(__file__).resolve().parents[2]
    pages = [root / "README.md", *sorted((root / "docs").glob("*.md"))]
    broken = []
    for page in pages:
        text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            if not linked.exists():
                broken.append(f"{page.name}: {target} (no such file)")
            elif anchor and linked.suffix == ".md":
                headings = re.findall(r"^#+ (.+)$", linked.read_text(encoding="utf-8"), flags=re.M)
                if anchor not in {_anchor(h) for h in headings}:
                    broken.append(f"{page.name}: {target} (no such heading)")
    assert len(pages) > 1 and not broken, broken


def test_the_docs_list_the_types_convert_writes():
    """The README and the command line's page name `convert transformer --type`'s choices as the command has them."""
    from comfyui_flux2dev.loaders.convert.presets import written_types

    root = pathlib.Path(__file__).resolve().parents[2]
    assert f"({', '.join(written_types())})" in (root / "README.md").read_text(encoding="utf-8")
    page = (root / "docs" / "command-line.md").read_text(encoding="utf-8")
    assert "--type " + "\\|".join(written_types()) + " " in page  # a table cell: each | escaped


def test_the_readme_names_each_node_and_model_file_as_the_pack_has_them():
    """The nodes table: one row per node, with its title and id as node_titles has them. The model files table: each
    file and pipeline the example workflows name, with the download address and folder the templates carry."""
    from comfyui_flux2dev.devtools.example_workflows import MODELS, PIPELINES
    from comfyui_flux2dev.loaders.models.node_titles import NODES

    readme = (pathlib.Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
    rows = [line for line in readme.splitlines() if line.startswith("| ")]
    assert sorted(row.split(" | ")[0] for row in rows if "(`Flux2Dev" in row) \
        == sorted(f"| {title} (`{node_id}`)" for node_id, (title, _) in NODES.items())
    for name, (folder, address, _) in MODELS.items():
        assert any(row.startswith(f"| `{name}`") and f"| {address} |" in row and f"`models/{folder}`" in row
                   for row in rows), name
    for name, (repository, _) in PIPELINES.items():
        assert any(row.startswith(f"| `{name}`") and repository in row for row in rows), name


def test_the_docs_list_the_gguf_types_the_pack_reads():
    """docs/dequantization.md names the GGUF types as the dequantizer's table has them."""
    from comfyui_flux2dev.loaders.formats.gguf_types import READ_TYPES

    page = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "dequantization.md").read_text(encoding="utf-8")
    listed = re.search(r"GGUF\s+types ((?:\w+, )+\w+ and \w+),", page).group(1)
    assert re.split(r", | and ", listed) == [qtype.name for qtype in READ_TYPES]


def test_the_docs_list_the_comfy_quant_formats_the_pack_reads():
    """docs/dequantization.md's table of comfy_quant formats has a row for each format word packing.FORMATS reads, and
    names each row's word as inspect reports it."""
    from comfyui_flux2dev.loaders.formats import packing

    page = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "dequantization.md").read_text(encoding="utf-8")
    section = page.split("## comfy_quant formats")[1].split("\n## ")[0]
    rows = [row.split(" | ") for row in section.splitlines() if row.startswith("| `")]
    words = {w for row in rows for w in re.findall(r"`(\w+)`", row[0])}
    assert words == set(packing.DECLARED)
    assert {re.search(r"`([\w-]+)` \|$", row[-1]).group(1) for row in rows} \
        == {f.label for f in packing.FORMATS if f.declared}
