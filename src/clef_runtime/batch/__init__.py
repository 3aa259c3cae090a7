"""Bulk decisions: ``clef batch INPUT OUTPUT``, in this process or on Ray Data.

The rows of INPUT (JSONL or Parquet: one System One request each, with an optional ``custom_id``) are read
and checked on the driver (`inputs`), the rows OUTPUT already holds are skipped (`output`: resumable), the
rest are grouped so that rows about the same state share a batch (`grouping`: the state is then computed
once, by the state cache), answered by workers that each hold one loaded `Clef` (`worker`), and committed by
the driver alone, each row exactly once (`pipeline`, `ray_data`). The command itself is `command`.
"""
