"""The DiLoCo engine, pure torch: it never imports transformers, accelerate, torchft or the glue above it.

The engine (`diloco.py`, `DiLoCo`) stands on rooms, each a concern, each importing only the rooms on the floors below
it (`tests/test_engine_structure.py` holds the order and the purity):

| floor | room | what it holds |
|---|---|---|
| 0 | `layout/` | the rank grid and its groups, the fragment partition, each rank's share, buffers, devices |
| 1 | `compression/` | codecs, low rank (PowerSGD), the adaptive policy: what a vector becomes on the wire |
| 2 | `settings/` | `DiLoCoConfig`, resume checks, the scaling laws' rules, the sync projection, the outer lr schedule |
| 3 | `exchange/` | averaging a vector across workers: the job, its transport, the pipelined pieces, low rank split |
| 4 | `rounds/` | a fragment's state, the overlap rules, completing a round, the round policy, stats, checkpoints |
| 5 | `membership/` | who takes part: start-up agreement, elastic membership and its background exchange |
| 5 | `store/` | rounds through an object store: contributions, manifests, quorum and grace, snapshots, signing |
"""

# The rooms, lowest floor first; a room imports only rooms of lower floors (rooms on one floor not each other).
FLOORS: tuple[tuple[str, ...], ...] = (
    ("layout",),
    ("compression",),
    ("settings",),
    ("exchange",),
    ("rounds",),
    ("membership", "store"),
)
