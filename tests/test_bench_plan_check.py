"""`benchmarks.plan_check`: what the planner chooses for the slow-link benchmark's model is what `benchmarks.wan`
trains (its method, H, P and codec), and `benchmarks.wan --codec` sets the codec of that run."""

from benchmarks import plan_check, wan
from hf_diloco.cli.plan import count_parameters
from hf_diloco.cli.plan_model import Sites, make_plan
from hf_diloco.core.settings.scaling_rules import Setting


def _plan(rate_mbit: float, step_seconds: float):
    sites = Sites(workers=2, gpus_per_site=1, link_gbit=rate_mbit / 1e3, latency_seconds=0.0, speeds=(1.0, 1.0))
    parameters = count_parameters(plan_check.WAN_MODEL, plan_check.WAN_VOCAB)
    return make_plan(parameters, sites, plan_check.WAN_SEQ_LEN, Setting(step_seconds, "test"), "h100", 0.4, None)


def test_the_wan_model_is_the_one_wan_builds():
    spec = {"seed": 0, "hidden": 128, "layers": 4, "seq_len": 128, "lr": 1e-3}
    model, _ = wan._build_model(spec)
    assert sum(p.numel() for p in model.parameters()) == count_parameters(plan_check.WAN_MODEL, plan_check.WAN_VOCAB)


def test_each_plan_runs_as_the_wan_method_with_its_settings():
    blocking = _plan(100.0, 0.15)  # fp32 at H = 30 keeps 91.8%: blocking DiLoCo
    assert (blocking.sync.fragments, blocking.sync.compression) == (1, "none")
    method, flags = plan_check.wan_method(blocking)
    assert method == "diloco"
    assert flags == ["--inner-steps", "30", "--fragments", "1", "--codec", "none"]
    streaming = _plan(10.0, 0.15)  # fp32 keeps at most 59%: Streaming DiLoCo, fp4
    method, flags = plan_check.wan_method(streaming)
    assert method == "streaming"
    assert flags == ["--inner-steps", "32", "--fragments", "4", "--codec", "fp4"]
    args = wan.parse_args(["--methods", "streaming", *flags, "--rates", "10"])
    spec = {key: getattr(args, key) for key in wan.SPEC_KEYS} | {"run_timeout": 60.0}
    config = wan.diloco_config(method, spec)
    assert (config.inner_steps, config.num_fragments, config.sync_delay, config.compression) == (32, 4, 1, "fp4")
    assert wan.diloco_config("diloco", spec | {"codec": None}).compression == "none"
    assert wan.diloco_config("streaming", spec | {"codec": "none"}).compression == "none"
