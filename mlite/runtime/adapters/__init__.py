"""The one place per library for the private names of other libraries that mlite's runtime reads.

Each module wraps what its library offers no public API for, names the version it was checked against,
and is guarded by tests/test_adapters.py, which fails naming the module to update when the library changes
under it: `pytorch` (torch: FSDP2's unit state, DTensor's strided shard, nn.Module's hook tables and
tensor walk, a view's base, DeviceMesh's flatten and unflatten, DCP's state traversal, the grouped matmul and
the foreach kernels) and `megatron_core` (Megatron-Core: its optimizer's kernel globals and a shard's
range). verl's are in mlite.integrations.verl.adapter. Nothing outside these modules reads another
library's private names.
"""
