"""evaluation/prefill_memory.py (every setting returns the same outputs; keeping every slot's logits costs
their memory, last-slot logits do not) and evaluation/cache_commit.py."""

from __future__ import annotations

import argparse

import pytest

from mmspec.evaluation import prefill_memory

TOKENS, VOCAB = 512, 16384  # every slot's fp32 logits: 32 MiB


def _args(**overrides) -> argparse.Namespace:
    values = dict(tokens=TOKENS, vocab=VOCAB, hidden=64, layers=2, threads=1, seed=0, one=None)
    return argparse.Namespace(**{**values, **overrides})


@pytest.mark.slow
def test_last_slot_logits_save_the_full_logits_memory_and_settings_agree():
    rows = prefill_memory.run(_args())  # raises if any setting returned other outputs than the defaults
    by_setting = {(row["prefill_logits"], row["read_hidden"]): row for row in rows}
    assert set(by_setting) == set(prefill_memory.SETTINGS)
    logits_mib = TOKENS * VOCAB * 4 / 2**20
    for read_hidden in ("hooks", "output_hidden_states"):
        last, every = by_setting["last", read_hidden], by_setting["all", read_hidden]
        assert last["logits_shape"] == [1, 1, VOCAB] and every["logits_shape"] == [1, TOKENS, VOCAB]
        assert every["peak_mib"] > last["peak_mib"] + logits_mib / 2, (last, every)
    table = prefill_memory.markdown(rows, _args())
    assert table.count("\n| ") == 1 + len(prefill_memory.SETTINGS)  # header + one row per setting


def test_one_setting_in_process_and_bad_sizes():
    row = prefill_memory.measure_one(_args(tokens=16, vocab=256), "last", "hooks")
    assert row["logits_shape"] == [1, 1, 256] and row["seconds"] > 0 and row["peak_mib"] >= 0
    with pytest.raises(SystemExit):
        prefill_memory.main(["--hidden", "100"])  # heads of width 64
    with pytest.raises(SystemExit):
        prefill_memory.main(["--tokens", "0"])


def test_cache_commit_times_both_commits_on_equal_caches(capsys):
    """evaluation/cache_commit.py: the in-place commit leaves the cache the concatenating one does (run()
    raises otherwise) and the table has a row per context."""
    from mmspec.evaluation import cache_commit

    cache_commit.main(["--contexts", "16", "40", "--layers", "2", "--kv-heads", "2", "--head-dim", "8",
                       "--rounds", "3", "--threads", "1"])
    table = capsys.readouterr().out
    assert "| 16 |" in table and "| 40 |" in table and table.count("\n| ") == 3  # header + 2 rows
    with pytest.raises(SystemExit):
        cache_commit.main(["--kept", "10", "--round-slots", "9"])


@pytest.mark.slow
def test_cache_commit_ab_on_the_vlm_zoo(capsys):
    """--vlm-zoo decodes the same texts with both commits (vlm_zoo_ab raises otherwise) and times both."""
    from mmspec.evaluation import cache_commit

    cache_commit.main(["--vlm-zoo", "1", "--repeats", "1", "--threads", "1"])
    table = capsys.readouterr().out
    assert "| none |" in table and "| eagle |" in table
