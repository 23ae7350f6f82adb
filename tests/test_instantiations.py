"""The generated kernel instantiations (ffi/cuda/attention/instantiations/) match their one list."""

import importlib.util
import pathlib
import re

ATTN = pathlib.Path(__file__).resolve().parent.parent / "ffi" / "cuda" / "attention"


def _generator():
  spec = importlib.util.spec_from_file_location("generate_instantiations",
                                                ATTN / "generate_instantiations.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_generated_files_are_current():
  stale = _generator().stale()
  assert not stale, (f"instantiations/ differs from instantiations.json in {stale}: run "
                     "python ffi/cuda/attention/generate_instantiations.py")


def test_each_kind_macro_is_defined_in_its_header():
  for kind, (include, macro) in _generator().KINDS.items():
    text = (ATTN / include).read_text()
    assert re.search(rf"^#define {macro}\(T, D\)", text, re.M), f"{kind}: {macro} not in {include}"
