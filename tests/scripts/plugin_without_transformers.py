"""A raw Accelerate loop with DiLoCoPlugin in a Python where `import transformers` fails: the Accelerate path of
hf_diloco must never need it. Launched by tests/test_plugin.py under torchrun (2 processes, one worker of 2
data-parallel ranks, so the plugin wraps the model in DDP over the worker's group); each rank prints what it saw.

    torchrun --nproc_per_node 2 tests/scripts/plugin_without_transformers.py OUT_DIR
"""

import importlib.abc
import sys

BLOCKED: list[str] = []


class RefuseTransformers(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "transformers" or name.startswith("transformers."):
            BLOCKED.append(name)
            raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)", name=name)
        return None


sys.meta_path.insert(0, RefuseTransformers())

from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from hf_diloco import DiLoCoPlugin  # noqa: E402

VOCAB, SEQ, STEPS, SAVE_AT = 32, 8, 6, 3


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, 16)
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))
        self.head = nn.Linear(16, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(ids)
        for layer in self.layers:
            hidden = torch.tanh(layer(hidden))
        return self.head(hidden)


def main() -> None:
    out = Path(sys.argv[1])
    accelerator = Accelerator(cpu=True)
    plugin = DiLoCoPlugin(inner_steps=2, data_parallel_per_worker=2, environ={})
    model = TinyLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, VOCAB, (64, SEQ), generator=torch.Generator().manual_seed(1))
    loader = DataLoader(TensorDataset(ids), batch_size=4)
    model, optimizer, loader = plugin.prepare(accelerator, model, optimizer, loader, max_steps=STEPS)
    for step, (batch,) in enumerate(loader, start=1):
        logits = model(batch[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1))
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        if step == SAVE_AT:
            accelerator.save_state(out / "state")
            accelerator.wait_for_everyone()  # rank 0 writes the model file every rank then reads
            accelerator.load_state(out / "state")
        if step == STEPS:
            break
    plugin.close()
    print(
        f"rank {accelerator.process_index}: inner_step={plugin.inner_step} "
        f"outer_steps={plugin.engine.stats['outer_steps']} ddp={type(model).__name__} "
        f"saved={(out / 'state' / f'diloco_state_rank{accelerator.process_index}.pt').is_file()} "
        f"transformers_imported={'transformers' in sys.modules} blocked={BLOCKED}"
    )
    accelerator.end_training()


if __name__ == "__main__":
    main()
