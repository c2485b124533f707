"""The offline data module: listing and split, the token stream (determinism, resume, content)
and the needle retrieval samples. No kernels run here."""

from __future__ import annotations

import json
import math
import os
import random
import re
from pathlib import Path

import pytest
import torch

from s2attn.training import data as D
from s2attn.training import needles, vocab


def _write_corpus(root: Path, num_files: int = 40, seed: int = 0) -> dict[str, bytes]:
    """Python-looking files of random sizes in nested packages; returns relpath -> content of the
    files a corpus should list (the decoys below must not be listed)."""
    rng = random.Random(seed)
    words = [b"def", b"return", b"class", b"import", b"self", b"x", b"=", b"(", b")", b":"]
    files = {}
    for i in range(num_files):
        rel = f"pkg{i % 4}/sub{i % 3}/mod_{i}.py" if i % 5 else f"top_{i}.py"
        text = b" ".join(rng.choice(words) for _ in range(rng.randint(5, 120))) + b"\n"
        text += "# ünïcode\n".encode()
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(text)
        files[rel] = text
    (root / "empty.py").write_bytes(b"")
    (root / "notes.txt").write_bytes(b"not python\n")
    (root / "pkg0" / "__pycache__").mkdir()
    (root / "pkg0" / "__pycache__" / "cached.py").write_bytes(b"x = 1\n")
    (root / "site-packages" / "other").mkdir(parents=True)
    (root / "site-packages" / "other" / "third_party.py").write_bytes(b"y = 2\n")
    os.symlink(root / "top_0.py", root / "link.py")
    # Walked after top_0.py (entries go in name order), so this second name is the one skipped.
    os.link(root / "top_0.py", root / "zz_hard_link.py")
    return files


@pytest.fixture
def corpus_root(tmp_path):
    root = tmp_path / "src"
    return root, _write_corpus(root)


def _concat(batches: list[torch.Tensor]) -> list[int]:
    return torch.cat([b.reshape(-1) for b in batches]).tolist()


def _documents(tokens: list[int]) -> list[bytes]:
    """Split a BOS-separated stream into documents; the first starts with BOS."""
    assert tokens[0] == vocab.BOS
    docs, cur = [], []
    for t in tokens[1:]:
        if t == vocab.BOS:
            docs.append(bytes(cur))
            cur = []
        else:
            cur.append(t)
    docs.append(bytes(cur))
    return docs


def test_encode_decode_round_trip():
    text = "déf f(x):\n    return x  # 数\n"
    ids = vocab.encode(text)
    assert ids == list(text.encode("utf-8")) and max(ids) < vocab.NUM_BYTES
    assert vocab.decode(ids) == text
    assert (
        vocab.decode([vocab.BOS, *vocab.encode("a"), vocab.KEY, vocab.VALUE, vocab.PAD])
        == "<BOS>a<KEY><VALUE><PAD>"
    )
    assert vocab.decode(torch.tensor(vocab.encode(b"xy"))) == "xy"
    with pytest.raises(ValueError, match="ids"):
        vocab.decode([vocab.VOCAB_SIZE])


def test_split_is_deterministic_disjoint_and_complete(corpus_root):
    root, expected = corpus_root
    train = D.SourceCorpus([root], split="train", val_fraction=0.3)
    val = D.SourceCorpus([root], split="val", val_fraction=0.3)
    train_rel = {rel for _, rel in train.files}
    val_rel = {rel for _, rel in val.files}
    assert not train_rel & val_rel
    assert train_rel | val_rel == set(expected)
    assert all(D.split_of(rel, 0.3) == "train" for rel in train_rel)
    assert all(D.split_of(rel, 0.3) == "val" for rel in val_rel)
    assert train.files == sorted(train.files) and len(val.files) > 0

    # The same answer from a fresh walk (not the process cache) and a fresh construction.
    D._LISTING_CACHE.clear()
    again = D.SourceCorpus([str(root)], split="train", val_fraction=0.3)
    assert again.files == train.files and again.fingerprint == train.fingerprint
    assert again.sizes == [len(expected[rel]) for _, rel in again.files]


def test_split_of_fraction():
    paths = [f"pkg/mod_{i}.py" for i in range(4000)]
    share = sum(D.split_of(p, 0.2) == "val" for p in paths) / len(paths)
    # 4000 draws at p=0.2: the standard deviation of the share is 0.0063.
    assert abs(share - 0.2) < 0.03, share
    assert all(D.split_of(p, 0.0) == "train" for p in paths[:50])
    assert all(D.split_of(p, 1.0) == "val" for p in paths[:50])
    # A path's side only grows towards val with the fraction: no file flips back.
    assert all(D.split_of(p, 0.5) == "val" for p in paths if D.split_of(p, 0.2) == "val")
    with pytest.raises(ValueError, match="val_fraction"):
        D.split_of("a.py", 1.5)


def test_listing_skips_decoys_and_reports_them(corpus_root):
    root, expected = corpus_root
    corpus = D.SourceCorpus([root], val_fraction=0.0)
    listed = {rel for _, rel in corpus.files}
    assert listed == set(expected)
    info = corpus.describe()
    assert info["roots"] == [str(root.resolve())] and info["files"] == len(expected)
    assert info["bytes"] == sum(len(v) for v in expected.values())
    assert info["skipped_when_listing"]["symlinks"] == 1
    assert info["skipped_when_listing"]["empty"] == 1
    assert info["skipped_when_listing"]["hard_links"] == 1
    json.dumps(info)


def test_nested_roots_list_each_file_once(corpus_root):
    root, expected = corpus_root
    corpus = D.SourceCorpus([root, root / "pkg1", root / "site-packages"], val_fraction=0.0)
    paths = [str(corpus.path(i)) for i in range(len(corpus))]
    assert len(paths) == len(set(paths)) == len(expected) + 1  # + site-packages/other/...
    assert {(r.name, rel) for r, rel in corpus.files if r.name == "pkg1"} == {
        ("pkg1", rel.removeprefix("pkg1/")) for rel in expected if rel.startswith("pkg1/")
    }


def test_bad_corpus_arguments(tmp_path):
    (tmp_path / "readme.txt").write_text("no python here")
    (tmp_path / "empty.py").write_text("")
    with pytest.raises(ValueError, match=re.escape(str(tmp_path.resolve()))):
        D.SourceCorpus([tmp_path])
    with pytest.raises(ValueError, match="not a directory"):
        D.SourceCorpus([tmp_path / "missing"])
    (tmp_path / "one.py").write_text("x = 1\n")
    with pytest.raises(ValueError, match="split"):
        D.SourceCorpus([tmp_path / "x"], split="test")
    with pytest.raises(ValueError, match="val_fraction"):
        D.SourceCorpus([tmp_path], val_fraction=-0.1)
    D._LISTING_CACHE.clear()
    with pytest.raises(ValueError, match="none falls in split 'val'"):
        D.SourceCorpus([tmp_path], split="val", val_fraction=0.0)


def test_stream_is_every_document_once_per_epoch(corpus_root):
    root, expected = corpus_root
    corpus = D.SourceCorpus([root], val_fraction=0.0)
    stream = D.TokenStream(corpus, seq_len=63, batch_size=3, seed=1)
    total = sum(len(v) + 1 for v in expected.values())
    batches = [stream.next_batch() for _ in range(2 * total // (3 * 64) + 2)]
    for b in batches:
        assert b.shape == (3, 64) and b.dtype == torch.int64
        assert int(b.min()) >= 0 and int(b.max()) <= vocab.BOS
    tokens = _concat(batches)
    assert vocab.PAD not in tokens and vocab.KEY not in tokens
    docs = _documents(tokens)
    n = len(expected)
    assert sorted(docs[:n]) == sorted(expected.values())
    assert sorted(docs[n : 2 * n]) == sorted(expected.values())
    assert docs[:n] != docs[n : 2 * n]  # each epoch has its own order
    assert stream.epoch >= 1


def test_stream_same_seed_same_batches(corpus_root):
    root, _ = corpus_root
    corpus = D.SourceCorpus([root], val_fraction=0.0)

    def take(seed):
        s = D.TokenStream(
            corpus, seq_len=40, batch_size=2, seed=seed, needle_fraction=0.3, needles_per_sample=1
        )
        return [s.next_batch() for _ in range(6)]

    a, b, c = take(7), take(7), take(8)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not all(torch.equal(x, y) for x, y in zip(a, c))


def test_stream_seed_reaches_needle_rows(tmp_path):
    # One file: every seed reads the same text, so only the needle rows can tell seeds apart.
    (tmp_path / "only.py").write_bytes(b"x = 1\n" * 50)
    corpus = D.SourceCorpus([tmp_path], val_fraction=0.0)

    def take(seed):
        s = D.TokenStream(
            corpus, seq_len=40, batch_size=4, seed=seed, needle_fraction=0.5, needles_per_sample=1
        )
        return torch.cat([s.next_batch() for _ in range(2)])

    a = take(7)
    assert torch.equal(a, take(7)) and not torch.equal(a, take(8))
    assert 0 < int((a == vocab.KEY).any(dim=1).sum()) < len(a)  # a mix of needle and text rows


@pytest.mark.parametrize("needle_fraction", [0.0, 0.5])
def test_stream_resumes_exactly(corpus_root, needle_fraction):
    root, _ = corpus_root
    corpus = D.SourceCorpus([root], val_fraction=0.0)

    def make():
        return D.TokenStream(
            corpus,
            seq_len=97,
            batch_size=3,
            seed=3,
            needle_fraction=needle_fraction,
            needles_per_sample=2,
        )

    stream = make()
    batches, state = [], None
    for i in range(5):
        batches.append(stream.next_batch())
        if i == 1:
            state = json.loads(json.dumps(stream.state_dict()))
    assert state["offset"] > 0  # saved mid-document, the case that needs the offset
    fresh = make()
    fresh.load_state_dict(state)
    for i in range(2, 5):
        assert torch.equal(fresh.next_batch(), batches[i]), f"batch {i} differs after resume"

    other = D.TokenStream(corpus, seq_len=97, batch_size=3, seed=4)
    with pytest.raises(ValueError, match="seed"):
        other.load_state_dict(state)
    with pytest.raises(ValueError, match="state"):
        fresh.load_state_dict({"format": 1, "config": state["config"], "epoch": -1})


def test_stream_skips_file_gone_after_listing(corpus_root):
    root, expected = corpus_root
    D._LISTING_CACHE.clear()
    corpus = D.SourceCorpus([root], val_fraction=0.0)
    gone = "top_5.py"
    (root / gone).unlink()
    stream = D.TokenStream(corpus, seq_len=255, batch_size=4, seed=0)
    total = sum(len(v) + 1 for v in expected.values())
    tokens = _concat([stream.next_batch() for _ in range(total // (4 * 256) + 2)])
    n = len(expected) - 1
    assert sorted(_documents(tokens)[:n]) == sorted(v for k, v in expected.items() if k != gone)
    assert corpus.describe()["unreadable_when_streaming"] == 1


def _filler(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab.KEY, (n,), generator=g)


@pytest.mark.parametrize("depth", [0.0, 0.3, 0.5, 1.0])
def test_needle_sample_layout(depth):
    key_len, value_len, length = 4, 6, 300
    filler = _filler(400)
    s = needles.make_needle_sample(filler, length, depth, random.Random(5), key_len, value_len)
    needle_len = 2 + key_len + value_len
    filler_len = length - 1 - 2 * needle_len
    assert s.tokens.shape == (length,) and s.tokens.dtype == torch.int64
    assert s.needle_start == 1 + round(depth * filler_len)
    assert s.answer_len == value_len and s.answer_start == length - value_len

    t = s.tokens.tolist()
    p = s.needle_start
    # BOS, then the filler's first filler_len tokens with the needle spliced in at p.
    assert t[0] == vocab.BOS and vocab.BOS not in filler.tolist()
    context = t[1:p] + t[p + needle_len : 1 + filler_len + needle_len]
    assert context == filler[:filler_len].tolist()
    needle = t[p : p + needle_len]
    question = t[1 + filler_len + needle_len :]
    assert needle[0] == vocab.KEY and needle[1 + key_len] == vocab.VALUE
    assert question == needle  # the question repeats the key; the answer is the value
    key, value = needle[1 : 1 + key_len], needle[2 + key_len :]
    assert all(chr(c).islower() for c in key) and all(chr(c).isdigit() for c in value)
    assert t[s.answer_start : s.answer_start + s.answer_len] == value
    assert t.count(vocab.KEY) == 2 and t.count(vocab.VALUE) == 2


def test_needle_sample_errors():
    rng = random.Random(0)
    with pytest.raises(ValueError, match="length"):
        needles.make_needle_sample(_filler(100), 24, 0.5, rng)  # needs 1 + 2 * (2 + 4 + 6) = 25
    needles.make_needle_sample(_filler(100), 25, 0.5, rng)  # no filler at all is allowed
    for depth in (-0.1, 1.5, math.nan):
        with pytest.raises(ValueError, match="depth"):
            needles.make_needle_sample(_filler(100), 60, depth, rng)
    with pytest.raises(ValueError, match="filler"):
        needles.make_needle_sample(_filler(10), 60, 0.5, rng)
    with pytest.raises(ValueError, match="filler"):
        needles.make_needle_sample(torch.full((60,), vocab.KEY), 60, 0.5, rng)


def test_multi_needle_answers_match_needles():
    n, key_len, value_len, length = 5, 3, 4, 500
    depths = [0.9, 0.1, 0.5, 0.5, 0.0]
    s = needles.make_multi_needle_sample(
        _filler(600), length, depths, random.Random(2), key_len, value_len
    )
    t = s.tokens.tolist()
    assert len(t) == length and len(set(s.keys)) == n
    assert t.count(vocab.KEY) == 2 * n
    needle_len = 2 + key_len + value_len
    filler_len = length - 1 - 2 * n * needle_len
    assert t[0] == vocab.BOS
    # Planted in depth order; equal depths keep their index order.
    by_position = sorted(range(n), key=lambda i: s.needle_starts[i])
    assert by_position == sorted(range(n), key=lambda i: depths[i])
    for i in range(n):
        start = s.needle_starts[i]
        planted_before = sum(s.needle_starts[j] < start for j in range(n))
        assert start - 1 - planted_before * needle_len == round(depths[i] * filler_len)
        assert t[start : start + needle_len] == [vocab.KEY, *s.keys[i], vocab.VALUE, *s.values[i]]
        answer = t[s.answer_starts[i] : s.answer_starts[i] + s.answer_len]
        assert answer == list(s.values[i])
        assert t[s.answer_starts[i] - 2 - key_len : s.answer_starts[i]] == [
            vocab.KEY,
            *s.keys[i],
            vocab.VALUE,
        ]
        assert s.answer_starts[i] >= 1 + filler_len + n * needle_len


def test_stream_needle_rows_answer_their_keys(corpus_root):
    root, _ = corpus_root
    corpus = D.SourceCorpus([root], val_fraction=0.0)
    n, key_len, value_len = 3, 4, 6
    stream = D.TokenStream(
        corpus,
        seq_len=199,
        batch_size=4,
        seed=0,
        needle_fraction=1.0,
        needles_per_sample=n,
        key_len=key_len,
        value_len=value_len,
    )
    for row in stream.next_batch().tolist():
        assert row[0] == vocab.BOS
        keys = [i for i, t in enumerate(row) if t == vocab.KEY]
        assert len(keys) == 2 * n
        spans = [tuple(row[i : i + 2 + key_len + value_len]) for i in keys]
        needles, questions = spans[:n], spans[n:]
        assert sorted(needles) == sorted(questions)
        assert keys[n] == len(row) - n * (2 + key_len + value_len)  # questions close the row


def test_stream_edge_fraction_plants_needles_at_the_ends(corpus_root):
    root, _ = corpus_root
    corpus = D.SourceCorpus([root], val_fraction=0.0)
    needle_len = 2 + 4 + 6

    def needle_starts(edge_fraction):
        stream = D.TokenStream(
            corpus,
            seq_len=399,
            batch_size=16,
            seed=3,
            needle_fraction=1.0,
            needles_per_sample=1,
            edge_fraction=edge_fraction,
        )
        return [row.index(vocab.KEY) for row in stream.next_batch().tolist()]

    first, last = 1, 400 - 2 * needle_len  # right after the BOS; right before the question
    ends = needle_starts(1.0)
    assert set(ends) == {first, last}  # only the ends, and both of them
    assert sum(s in (first, last) for s in needle_starts(0.0)) <= 2  # uniform: ends are rare


def test_needle_filler_is_deterministic(corpus_root):
    root, _ = corpus_root
    corpus = D.SourceCorpus([root], val_fraction=0.0)
    a = D.needle_filler(corpus, 500, seed=1)
    # The stream's leading BOS is dropped: the retrieval sample brings its own.
    assert a.shape == (500,) and a[0] != vocab.BOS and int(a.max()) <= vocab.BOS
    assert torch.equal(a, D.needle_filler(corpus, 500, seed=1))
    assert not torch.equal(a, D.needle_filler(corpus, 500, seed=2))
    s = needles.make_needle_sample(a, 500, 0.0, random.Random(0))
    assert s.tokens.shape == (500,) and s.tokens[0] == vocab.BOS and s.needle_start == 1
    assert s.tokens.tolist().count(vocab.BOS) == a[: 500 - 1 - 2 * 12].tolist().count(vocab.BOS) + 1


def test_stream_rejects_bad_arguments(corpus_root):
    root, _ = corpus_root
    corpus = D.SourceCorpus([root], val_fraction=0.0)
    with pytest.raises(ValueError, match="seq_len"):
        D.TokenStream(corpus, seq_len=0, batch_size=1)
    with pytest.raises(ValueError, match="needle_fraction"):
        D.TokenStream(corpus, seq_len=64, batch_size=1, needle_fraction=2.0)
    with pytest.raises(ValueError, match="edge_fraction"):
        D.TokenStream(corpus, seq_len=64, batch_size=1, edge_fraction=-0.1)
    with pytest.raises(ValueError, match="seq_len must be >= 96"):
        D.TokenStream(corpus, seq_len=64, batch_size=1, needle_fraction=0.5, needles_per_sample=4)


def test_default_roots_list_and_stream():
    roots = D.default_roots()
    assert roots and all(r.is_dir() for r in roots) and len(set(roots)) == len(roots)
    train = D.SourceCorpus(split="train")
    val = D.SourceCorpus(split="val")
    assert len(train) > 100 and len(val) > 0
    assert not {(str(r), p) for r, p in train.files} & {(str(r), p) for r, p in val.files}
    paths = [train.path(i) for i in range(len(train))]
    assert len(set(paths)) == len(paths)
    stream = D.TokenStream(train, seq_len=1023, batch_size=2, seed=0, needle_fraction=0.5)
    for _ in range(3):
        x = stream.next_batch()
        assert x.shape == (2, 1024) and int(x.max()) < vocab.VOCAB_SIZE


def test_installing_a_package_leaves_the_default_corpus_as_it_was(tmp_path, monkeypatch):
    """The default corpus is the standard library alone: a package installed into site-packages
    (the venv's, or the one inside the stdlib directory of an interpreter without a venv) adds
    no file to it, so a run's data, and its fingerprint, stay put."""
    stdlib, venv = tmp_path / "lib" / "python3.x", tmp_path / "venv" / "site-packages"
    for i in range(30):
        (stdlib / f"mod_{i}.py").parent.mkdir(parents=True, exist_ok=True)
        (stdlib / f"mod_{i}.py").write_text(f"x = {i}\n" * (i + 1))
    inner = stdlib / "site-packages"
    for site in (inner, venv):
        (site / "old_pkg").mkdir(parents=True)
        (site / "old_pkg" / "__init__.py").write_text("y = 1\n")
    paths = {"stdlib": str(stdlib), "purelib": str(venv), "platlib": str(venv)}
    monkeypatch.setattr(D.sysconfig, "get_paths", lambda: dict(paths))
    assert D.default_roots() == [stdlib.resolve()]

    def fresh(split):
        monkeypatch.setattr(D, "_LISTING_CACHE", {})  # a new process lists the files again
        return D.SourceCorpus(split=split, val_fraction=0.2)

    before = {split: fresh(split) for split in ("train", "val")}
    assert all(rel.startswith("mod_") for c in before.values() for _, rel in c.files)
    for site in (inner, venv):
        (site / "new_pkg").mkdir()
        (site / "new_pkg" / "__init__.py").write_text("z = 2\n" * 100)
        (site / "old_pkg" / "__init__.py").write_text("y = 2  # upgraded\n")
    for split, corpus in before.items():
        after = fresh(split)
        assert (after.files, after.sizes) == (corpus.files, corpus.sizes)
        assert after.fingerprint == corpus.fingerprint
    # The check can fail: a file added to the standard library directory itself is seen.
    (stdlib / "mod_new.py").write_text("w = 3\n")
    both = [fresh(split) for split in ("train", "val")]
    assert sum(map(len, both)) == sum(map(len, before.values())) + 1


def test_stream_marks_exactly_the_answers(corpus_root):
    root, _ = corpus_root
    corpus = D.SourceCorpus([root], val_fraction=0.0)
    n, value_len = 2, 6
    stream = D.TokenStream(
        corpus,
        seq_len=199,
        batch_size=6,
        seed=3,
        needle_fraction=0.5,
        needles_per_sample=n,
        value_len=value_len,
    )
    state = stream.state_dict()
    tokens, answers = stream.next_batch_with_answers()
    stream.load_state_dict(state)
    assert torch.equal(stream.next_batch(), tokens)  # the same batch either way
    for row, marked in zip(tokens.tolist(), answers.tolist()):
        keys = [i for i, t in enumerate(row) if t == vocab.KEY]
        if not keys:  # a plain text row: nothing to retrieve
            assert not any(marked)
            continue
        assert row[0] == vocab.BOS
        # The answers follow the questions' VALUE markers, the last n of the row.
        values = [i for i, t in enumerate(row) if t == vocab.VALUE][n:]
        want = {i for v in values for i in range(v + 1, v + 1 + value_len)}
        assert {i for i, m in enumerate(marked) if m} == want
