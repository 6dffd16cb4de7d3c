"""Packaging (pyproject.toml): the package sits at the repository root, so an editable install is a
.pth entry for the root (setuptools' other choice, an import hook, warns that folders named like
the package in the working directory may shadow it), and the wheel's package data holds every
file of the bundled pair."""

import glob
import os
import tomllib

import ddtree_jax as dj

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _setuptools() -> dict:
  with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
    return tomllib.load(f)["tool"]["setuptools"]


def test_an_editable_install_is_a_path_entry_for_the_package_alone():
  """setuptools writes a .pth entry only for a package-dir of the root alone over packages that
  all import from it; the discovery takes ddtree_jax and its subpackages, nothing else."""
  st = _setuptools()
  assert st["package-dir"] == {"": "."}
  assert st["packages"]["find"]["include"] == ["ddtree_jax*"]
  assert os.path.dirname(os.path.dirname(os.path.abspath(dj.__file__))) == REPO


def test_the_package_data_holds_every_file_of_the_bundled_pair():
  package = os.path.dirname(os.path.abspath(dj.__file__))
  shipped = {f for pattern in _setuptools()["package-data"]["ddtree_jax"]
             for f in glob.glob(pattern, root_dir=package)}
  files = {os.path.relpath(os.path.join(d, n), package)
           for d, _, names in os.walk(dj.DEFAULT_MODEL_DIR) for n in names}
  assert files and files <= shipped, sorted(files - shipped)
  assert {"target/config.json", "target/model.safetensors", "target/tokenizer.json",
          "drafter/config.json", "drafter/model.safetensors"} <= {
              os.path.relpath(f, "default_model") for f in files}
