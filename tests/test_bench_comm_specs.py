"""`scripts/bench_comm.py` method specs: DiLoCoConfig overrides, the inner learning rate (DDP's too), workers."""

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_comm.py"


def _load():
    spec = importlib.util.spec_from_file_location("bench_comm", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_learning_rate_is_a_run_setting_for_ddp_and_diloco():
    module = _load()
    assert module.parse_method("ddp:lr=0.003@2") == ("ddp", None, 2)
    assert module.run_overrides("ddp:lr=0.003@2") == {"lr": 0.003}
    name, fields, workers = module.parse_method("diloco_h50:outer_lr=0.5,lr=0.001")
    assert (name, workers) == ("diloco_h50", None)
    assert fields == {"inner_steps": 50, "outer_lr": 0.5}
    assert module.run_overrides("diloco_h50:outer_lr=0.5,lr=0.001") == {"lr": 0.001}
    assert module.run_overrides("diloco_h50:outer_lr=0.5@2") == {}


@pytest.mark.parametrize("spec", ["ddp:outer_lr=0.5", "diloco:not_a_field=1", "no_such_method"])
def test_unknown_settings_are_refused(spec):
    with pytest.raises(ValueError):
        _load().parse_method(spec)
