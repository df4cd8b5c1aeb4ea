"""A snapshot decoded in the background while the model loads: used only for the very file restored.

The CLI starts the prefetch before it loads the model; the restore claims it. What a user relies
on: the resumed answer is the one a plain restore gives, the prefix really is not read again, a
file saved over in between is read afresh, and a damaged file is refused with the usual message.
"""

from __future__ import annotations

import os
import shutil

import pytest

from kvsnap.config import SamplingParams
from kvsnap.engine import restore as restoring
from kvsnap.engine.session import Session
from kvsnap.errors import SnapshotError
from kvsnap.format import prefetch

GREEDY = SamplingParams(max_new_tokens=5, temperature=0)
IDS = list(range(11, 11 + 120))


@pytest.fixture
def saved(llama, tmp_path):
    session = Session(llama, block_size=16)
    session.prefill(IDS[:90])
    path = tmp_path / "doc.kv"
    session.save(path)
    yield path
    prefetch.discard()


def _no_second_read(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the prefix was read again on the main thread")

    monkeypatch.setattr(restoring, "_read_blocks", refuse)


def test_a_prefetched_resume_answers_as_a_plain_one_without_reading_again(llama, saved, monkeypatch, forward_counter):
    plain = Session(llama, block_size=16).run(IDS, GREEDY, resume=saved)
    prefetch.start(saved)
    _no_second_read(monkeypatch)
    counter = forward_counter(llama)
    result = Session(llama, block_size=16).run(IDS, GREEDY, resume=saved)
    assert result.text == plain.text
    assert result.hit_tokens == plain.hit_tokens == 90 and result.prefill_tokens == len(IDS) - 90
    assert counter.tokens == len(IDS) - 90 + GREEDY.max_new_tokens - 1
    assert prefetch.claim(saved) is None  # claimed once


def test_a_file_saved_over_after_the_prefetch_is_read_afresh(llama, saved, tmp_path):
    other = Session(llama, block_size=16)
    other.prefill(IDS[5:100])
    prefetch.start(saved)
    prefetch.claim(saved)  # nothing left to claim afterwards
    prefetch.start(saved)
    other.save(tmp_path / "other.kv")
    st = os.stat(saved)
    shutil.copyfile(tmp_path / "other.kv", saved)
    os.utime(saved, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    result = Session(llama, block_size=16).run(IDS[5:100] + [3, 4], GREEDY, resume=saved)
    assert result.hit_tokens == 95  # the new file's tokens, not the prefetched ones
    assert result.text == Session(llama, block_size=16).run(IDS[5:100] + [3, 4], GREEDY).text


def test_a_damaged_prefetched_file_is_refused_as_without_a_prefetch(llama, saved):
    data = bytearray(saved.read_bytes())
    data[-200] ^= 0xFF
    saved.write_bytes(bytes(data))
    with pytest.raises(SnapshotError) as plain:
        Session(llama, block_size=16).restore(saved, IDS)
    prefetch.start(saved)
    with pytest.raises(SnapshotError) as fetched:
        Session(llama, block_size=16).restore(saved, IDS)
    assert str(fetched.value) == str(plain.value)


def test_a_prefetch_of_a_fifo_or_a_missing_file_ends_and_the_restore_reports_it(llama, tmp_path):
    fifo = tmp_path / "pipe.kv"
    os.mkfifo(fifo)
    prefetch.start(fifo)
    prefetch.start(tmp_path / "missing.kv")
    with pytest.raises(SnapshotError):
        Session(llama, block_size=16).restore(fifo, IDS)
    with pytest.raises(SnapshotError):
        Session(llama, block_size=16).restore(tmp_path / "missing.kv", IDS)
