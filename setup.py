"""Puts the bundled drafters (checkpoints/ at the repository root) inside a built wheel, as
dominotree/checkpoints/, so `pip install .` gives `load_drafter("smollm2-135m-domino")` too.
An editable install reads them from the checkout instead (models.checkpoints_dir)."""
import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
DRAFTER_FILES = ("config.json", "model.safetensors")


class BuildWithDrafters(build_py):
    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            return
        for ckpt in sorted((ROOT / "checkpoints").glob("*/config.json")):
            dest = Path(self.build_lib) / "dominotree" / "checkpoints" / ckpt.parent.name
            dest.mkdir(parents=True, exist_ok=True)
            for name in DRAFTER_FILES:
                shutil.copyfile(ckpt.parent / name, dest / name)


setup(cmdclass={"build_py": BuildWithDrafters})
