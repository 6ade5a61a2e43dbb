"""`stalepipe.delay` is the stable API's entry (docs/api.md): the training wing's delay names,
each the very object, loaded on first use."""

import subprocess
import sys

import pytest

import stalepipe.delay as public
from stalepipe.training import delay as impl


def test_the_public_names_are_the_training_wings_own():
    assert public.__all__ == impl.__all__
    for name in public.__all__:
        assert getattr(public, name) is getattr(impl, name)


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="stalepipe.delay"):
        public.DelayedOptimiser  # noqa: B018


def test_importing_it_loads_no_torch():
    code = "import sys, stalepipe.delay; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
