"""A defect for tests/test_sharded_bench.py: camkv places every tensor-parallel rank's
heads at global head 0, so each rank's gate draws what rank 0's draws. Imported at the
start of every Python of a run whose PYTHONPATH holds this folder."""

from camkv.distributed import ShardInfo


def _heads_at_zero(self, local_heads: int) -> tuple[int, int]:
    return 0, self.tensor_size * local_heads


ShardInfo.head_placement = _heads_at_zero
