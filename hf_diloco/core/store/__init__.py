"""Rounds through an object store: sites that cannot reach each other exchange their pseudo-gradients through a
bucket (S3, GCS, Azure, a Hugging Face Storage Bucket, a shared folder), asynchronously within a deadline.

| module | what it holds |
|---|---|
| `objects.py` | the `ObjectStore` protocol a backend implements, and every call bounded in time |
| `sealing.py` | the job's keys, and an object as header + HMAC + payload, verified and bounded before it is parsed |
| `names.py` | where each object lives in the store |
| `tensors.py` | snapshots' tensors in the safetensors format, written and read without the library |
| `manifest.py` | one round's decision: who contributed with what weight, and the rule that closes a round |
| `board.py` | one site's reads and writes of contributions, manifests, snapshots and heartbeats |
| `site.py` | the ranks of one site agreeing through their own gloo group |
| `rounds.py` | `StoreRounds`: the engine's side (launch, apply, join, close) |

docs/design.md, "Sites that cannot reach each other", states the protocol and why each rule holds. The library that
reaches a real store lives outside the core (`hf_diloco.backends.object_store`).

Floor 5: may import `layout`, `compression`, `settings`, `exchange` and `rounds`.
"""
