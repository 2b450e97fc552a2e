"""docs/configs.md lists every config key as `train.py --help` does."""

import runpy
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_configs_page_lists_the_current_keys():
    render = runpy.run_path(str(ROOT / "docs" / "update_configs.py"))["render"]
    page = (ROOT / "docs" / "configs.md").read_text()
    assert render(page) == page, "docs/configs.md is out of date: python docs/update_configs.py"
    assert "train.wandb_project" in page and "parallel.ds_config" in page
