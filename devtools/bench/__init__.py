"""`flux2dev bench`: scenarios (what is run), meters (how it is measured) and report (how it is shown)."""

from .report import format_report, format_table
from .scenarios import run_all

__all__ = ["format_report", "format_table", "run_all"]
