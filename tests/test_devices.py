"""Which device a process means: `global_copy_device` resolved to this rank's accelerator, the FSDP mesh's device type
from where the parameters are, and every restored checkpoint tensor on its fragment's device."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hf_diloco import DiLoCo, DiLoCoConfig
from hf_diloco.core.layout.devices import local_device, placed, resolve_device
from hf_diloco.core.rounds import checkpoint
from hf_diloco.parallel.fsdp import mesh_device_type, worker_mesh
from tests.dist_utils import run_on_processes
from tests.engine_common import INNER_LR, batch_for, inner_step, tiny_model

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (GPU lane)")


def test_a_cuda_device_without_index_is_this_process_s_own():
    on_gpu_3 = [torch.device("cuda", 3), torch.device("cpu")]
    assert resolve_device(
        "cuda", [torch.device("cpu"), *on_gpu_3], local_rank=5, current_index=0, device_count=8
    ) == torch.device("cuda", 3)  # the parameters' GPU first
    assert resolve_device("cuda", local_rank=5, current_index=0, device_count=8) == torch.device("cuda", 5)
    assert resolve_device("cuda", local_rank=5, current_index=0, device_count=1) == torch.device(
        "cuda", 0
    )  # one visible
    assert resolve_device("cuda", current_index=2, device_count=8) == torch.device("cuda", 2)
    assert resolve_device("cuda") == torch.device("cuda", 0)
    assert resolve_device("cuda:1", on_gpu_3, local_rank=5, device_count=8) == torch.device("cuda", 1)  # named: kept
    assert resolve_device("cpu", on_gpu_3, local_rank=5, device_count=8) == torch.device("cpu")
    assert local_device("cpu", tiny_model().parameters()) == torch.device("cpu")


def test_mesh_device_type_follows_the_parameters_then_the_backends():
    gpu, cpu, meta = [torch.device("cuda", 1)], [torch.device("cpu")], [torch.device("meta")]
    mixed = "cpu:gloo,cuda:nccl"  # also what init_process_group() without a backend makes on a CUDA machine
    assert mesh_device_type(gpu, mixed, cuda_available=True) == "cuda"
    assert mesh_device_type(gpu + cpu, "cpu:gloo,cuda:gloo", cuda_available=True) == "cuda"  # gloo, GPU parameters
    assert mesh_device_type(cpu, mixed, cuda_available=True) == "cpu"
    assert mesh_device_type(cpu, "cuda:nccl", cuda_available=True) == "cuda"  # NCCL cannot run a CPU mesh
    assert mesh_device_type(meta, mixed, cuda_available=True) == "cuda"  # nothing placed yet: the backends decide
    assert mesh_device_type([], mixed, cuda_available=True) == "cuda"
    assert mesh_device_type([], "cuda:nccl", cuda_available=True) == "cuda"
    assert mesh_device_type([], "cpu:gloo,cuda:gloo", cuda_available=True) == "cpu"  # gloo alone: as before
    assert mesh_device_type([], "cpu:gloo", cuda_available=False) == "cpu"
    assert mesh_device_type(meta, mixed, cuda_available=False) == "cpu"


def _mesh_types(rank: int, world: int) -> list[str]:
    config = DiLoCoConfig(inner_steps=2)
    with torch.device("meta"):
        on_meta = nn.Linear(4, 4)
    meshes = [
        worker_mesh(config),
        worker_mesh(config, model=nn.Linear(4, 4)),
        worker_mesh(config, model=on_meta),
        worker_mesh(config, "cpu"),
    ]
    return [mesh.device_type for mesh in meshes]


def test_worker_mesh_keeps_its_signature_and_takes_the_model():
    assert run_on_processes(_mesh_types, 1) == [["cpu", "cpu", "cpu", "cpu"]]


def _eager_engine(device: str = "cpu") -> tuple[nn.Module, torch.optim.Optimizer, DiLoCo]:
    model = tiny_model().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=INNER_LR)
    config = DiLoCoConfig(inner_steps=4, num_fragments=2, overlap="eager", global_copy_device=device)
    return model, optimizer, DiLoCo(model, optimizer, config)


def _train(model, optimizer, engine, steps: range) -> None:
    for t in steps:
        batch = {key: value.to(next(model.parameters()).device) for key, value in batch_for(0, t).items()}
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        engine.step()


def test_restored_tensors_are_moved_to_the_fragment_s_device(monkeypatch):
    """A state is read on the host (`map_location="cpu"`); the pseudo-gradient sent with an exchange in flight is put
    back on its fragment's device, where eager subtracts it from the next one. On CPU: `placed` really moves to
    another device (`meta`), and loading asks it for the fragment's device for every restored `sent`."""
    moved = placed(torch.ones(3), torch.device("meta"))
    assert moved.device == torch.device("meta") and placed(None, torch.device("meta")) is None
    kept = torch.ones(3)
    assert placed(kept, torch.device("cpu")) is kept

    model, optimizer, engine = _eager_engine()
    for t in range(1, 7):
        inner_step(model, optimizer, 0, t)
        engine.step()
    state = engine.state_dict()
    assert state["pending"] and all(item["sent"] is not None for item in state["pending"].values())

    asked = []
    monkeypatch.setattr(checkpoint, "placed", lambda tensor, device: asked.append(device) or placed(tensor, device))
    other_model, other_optimizer, other = _eager_engine()
    other.load_state_dict(state)
    pending = [other.fragments[int(index)] for index in state["pending"]]
    assert asked == [fragment.device for fragment in pending]
    assert all(fragment.flight.sent.device == fragment.device for fragment in pending)


@pytest.mark.gpu
@requires_cuda
def test_gpu_eager_resume_with_the_global_copy_on_cuda_continues_bitwise(tmp_path):
    """GPU lane. `global_copy_device="cuda"` means the parameters' GPU (here the current one), and an eager state
    written there, read back on the host as the front-ends do, resumes without mixing devices and bitwise."""
    model, optimizer, engine = _eager_engine("cuda")
    assert all(fragment.device == next(model.parameters()).device for fragment in engine.fragments)
    _train(model, optimizer, engine, range(1, 7))
    torch.save(engine.state_dict(), tmp_path / "state.pt")
    _train(model, optimizer, engine, range(7, 13))
    resumed_model, resumed_optimizer, resumed = _eager_engine("cuda")
    resumed.load_state_dict(torch.load(tmp_path / "state.pt", map_location="cpu", weights_only=True))
    assert all(f.flight.sent.device == f.device for f in resumed.fragments if f.flight is not None)
    _train(resumed_model, resumed_optimizer, resumed, range(7, 13))
    for name, value in engine.global_parameters().items():
        assert torch.equal(resumed.global_parameters()[name], value), name
