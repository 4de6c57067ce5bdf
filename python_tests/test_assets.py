"""FlashHead assets: published layout round trips in both directions, malformed assets, the cache."""
import copy
import hashlib
import dataclasses
import json
import os
import re
import stat
import time
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from flashhead_ext import assets as assets_mod
from flashhead_ext.assets import (CONFIG_NAME, TENSORS_NAME, FlashHeadAssets, flash_head_for, load_assets,
                                  save_assets)
from flashhead_ext.clustering import build_clusters, calibrate_clusters

VOCAB, DIM, SIZE = 96, 12, 8


@pytest.fixture(scope="module")
def embedding():
    return torch.randn(VOCAB, DIM, generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def clustering(embedding):
    return build_clusters(embedding, SIZE, iters=3, progress=False)


def _hidden(rows=9):
    return torch.randn(rows, DIM, generator=torch.Generator().manual_seed(1))


def test_save_then_load_round_trip(tmp_path, embedding, clustering):
    save_assets(tmp_path, clustering, n_probes=3, special_token_ids=[5, 2])
    stored = load_file(str(tmp_path / "flash_head_assets" / TENSORS_NAME))
    assert stored["centroids"].shape == (DIM, VOCAB // SIZE)  # published layout: hidden x clusters
    assert stored["cluster_assignments"].shape == (VOCAB,)
    config = json.loads((tmp_path / CONFIG_NAME).read_text())
    assert config == {"flash_head_cache_dir": "flash_head_assets", "n_clusters": VOCAB // SIZE, "n_probes": 3,
                      "flash_head_special_token_ids": [5, 2], "enforce_equal_cluster_sizes": True,
                      "flash_head_greedy_scoring": "normalized", "flash_head_tensors_sha256": hashlib.sha256(
                          (tmp_path / "flash_head_assets" / TENSORS_NAME).read_bytes()).hexdigest()}

    loaded = load_assets(tmp_path, embedding)
    assert torch.equal(loaded.cluster_assignments, clustering.cluster_assignments)
    assert torch.equal(loaded.cluster_tokens, clustering.cluster_tokens)
    assert torch.equal(loaded.raw_centroids, clustering.raw_centroids)
    assert (loaded.n_probes, loaded.special_token_ids) == (3, [5, 2])
    original = FlashHeadAssets.from_clustering(clustering, n_probes=3, special_token_ids=[5, 2]).head(embedding)
    head = loaded.head(embedding)
    assert head.probes == 3 and head.extra_ids.tolist() == [2, 5]
    assert torch.equal(head.next_token(_hidden()), original.next_token(_hidden()))
    # Greedy ranks with normalised centroids, sampling with the raw ones.
    torch.testing.assert_close(head.centroids, torch.nn.functional.normalize(clustering.raw_centroids, dim=1))
    assert torch.equal(head.sampling_centroids, clustering.raw_centroids)


def test_save_writes_nothing_when_the_config_cannot_be_written(tmp_path, clustering):
    assets = FlashHeadAssets.from_clustering(clustering, n_probes=3)
    save_assets(tmp_path, assets)
    before = {path: path.read_bytes() for path in tmp_path.rglob("*") if path.is_file()}
    other = FlashHeadAssets.from_clustering(build_clusters(torch.randn(VOCAB, DIM), SIZE, iters=1, progress=False),
                                            special_token_ids=[1])
    for bad in (["eos"], [3.7]):  # set by hand: not ids
        other.special_token_ids = bad
        with pytest.raises(TypeError, match="cannot be interpreted as an integer"):
            save_assets(tmp_path, other)
    assert {path: path.read_bytes() for path in tmp_path.rglob("*") if path.is_file()} == before
    other.special_token_ids = torch.tensor([4, 1])  # ids as a tensor are written as ints
    save_assets(tmp_path, other)
    assert load_assets(tmp_path).special_token_ids == [4, 1]


def test_save_refuses_settings_that_load_would_refuse(tmp_path, clustering):
    clusters = VOCAB // SIZE
    for settings, error, match in (
            (dict(n_probes=0), ValueError, f"n_probes must be an int in 1..{clusters} \\(n_clusters\\), got 0"),
            (dict(n_probes=10**6), ValueError, "n_probes must be an int in 1.."),
            (dict(n_probes=2.5), ValueError, "n_probes must be an int in 1.."),
            (dict(special_token_ids=[10**6]), ValueError, f"special_token_ids must be in \\[0, {VOCAB}\\)"),
            (dict(special_token_ids=[2.5]), TypeError, "special_token_ids must be integer token ids")):
        with pytest.raises(error, match=match):
            save_assets(tmp_path, clustering, **settings)
    assets = FlashHeadAssets.from_clustering(clustering)
    assets.special_token_ids = [VOCAB]  # set by hand
    with pytest.raises(ValueError, match=f"flash_head_special_token_ids must be a list of token ids in \\[0, {VOCAB}\\)"):
        save_assets(tmp_path, assets)
    assert not any(tmp_path.iterdir())  # nothing written that load_assets would refuse


def test_save_refuses_assets_that_load_would_refuse(tmp_path, embedding, clustering):
    good = FlashHeadAssets.from_clustering(clustering)
    padded = build_clusters(embedding[:VOCAB - 3], SIZE, iters=1, progress=False)
    nan = good.raw_centroids.clone()
    nan[2, 3] = float("nan")
    for changes, error, match in (
            # The dataclass's default enforces equal sizes, which a padded clustering does not have.
            (dict(raw_centroids=padded.raw_centroids, cluster_assignments=padded.cluster_assignments),
             ValueError, "enforce_equal_cluster_sizes is set but cluster sizes range from 7"),
            (dict(raw_centroids=nan), ValueError, "centroids in the assets to save .* hold NaN or infinite values"),
            (dict(greedy_scoring="unit"), ValueError, "flash_head_greedy_scoring must be one of"),
            (dict(enforce_equal_cluster_sizes="false"), ValueError, "enforce_equal_cluster_sizes must be true or false"),
            (dict(cluster_assignments=good.cluster_assignments % 5), ValueError, "cluster 5 has no tokens"),
            (dict(raw_centroids=good.raw_centroids[:0]), ValueError,
             r"the assets to save \(assets.raw_centroids transposed\) hold no clustering: centroids \(12, 0\)"),
            (dict(raw_centroids=good.raw_centroids.numpy()), TypeError,
             r"assets.raw_centroids must be a torch.Tensor \[clusters, hidden\], got ndarray"),
            (dict(cluster_assignments=good.cluster_assignments[None]), ValueError,
             r"assets.cluster_assignments must have shape \[vocab\], got \(1, 96\)"),
            (dict(cache_dir=".."), ValueError, "flash_head_cache_dir must be a directory inside the assets directory"),
            (dict(cache_dir=str(tmp_path / "elsewhere")), ValueError, "a relative path without '..'"),
            (dict(cache_dir=3), ValueError, r"flash_head_cache_dir must be a directory name \(a string\), got 3")):
        with pytest.raises(error, match=match):
            save_assets(tmp_path / "out", dataclasses.replace(good, **changes))
    assert not (tmp_path / "out").exists() and not (tmp_path / "elsewhere").exists()


def test_save_stores_the_published_dtypes(tmp_path, embedding, clustering):
    good = FlashHeadAssets.from_clustering(clustering, n_probes=2)
    save_assets(tmp_path, dataclasses.replace(good, raw_centroids=good.raw_centroids.double(),
                                              cluster_assignments=good.cluster_assignments.int()))
    stored = load_file(str(tmp_path / "flash_head_assets" / TENSORS_NAME))
    assert stored["centroids"].dtype == torch.float32 and stored["cluster_assignments"].dtype == torch.int64
    loaded = load_assets(tmp_path, embedding)
    assert torch.equal(loaded.raw_centroids, good.raw_centroids) and torch.equal(loaded.cluster_tokens, good.cluster_tokens)


def test_save_refuses_arguments_in_the_wrong_order(tmp_path, clustering):
    with pytest.raises(TypeError, match=re.escape("assets must be a FlashHeadAssets or a Clustering (save_assets(directory, "
                                                  "assets)), got PosixPath")):
        save_assets(clustering, tmp_path)
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("vocab,size", [(10, 7), (17, 16), (101, 16)])
def test_a_cached_clustering_has_the_table_it_was_built_with(tmp_path, monkeypatch, vocab, size):
    # Where no cluster is full (P >= C) the table had kept width b when built and come back as wide
    # as its largest cluster from the cache, so a head's candidate count changed between runs.
    monkeypatch.setenv("FLASHHEAD_CACHE_DIR", str(tmp_path))
    embedding = torch.randn(vocab, DIM, generator=torch.Generator().manual_seed(vocab))
    built, _ = flash_head_for(embedding, size, progress=False)
    cached, _ = flash_head_for(embedding, size, progress=False)
    assert torch.equal(built.cluster_tokens, cached.cluster_tokens) and built.num_candidates == cached.num_candidates


def test_concurrent_writes_of_one_file_each_land_whole(tmp_path):
    # Two writers of one cache file at once (ranks of a job): neither removes the other's partial file.
    target = tmp_path / "entry.txt"

    def outer(partial):
        partial.write_text("outer")
        assets_mod.write_replacing(target, lambda inner: inner.write_text("inner"))

    assets_mod.write_replacing(target, outer)
    assert target.read_text() == "outer" and [p.name for p in tmp_path.iterdir()] == ["entry.txt"]


def test_partial_files_a_killed_write_left_are_removed_by_the_next_write(tmp_path):
    target = tmp_path / "entry.txt"
    stale, fresh = tmp_path / ".entry.txt.abc.partial", tmp_path / ".entry.txt.def.partial"
    other, other_fresh = tmp_path / ".other.txt.abc.partial", tmp_path / ".other.txt.def.partial"
    for path in (stale, fresh, other, other_fresh):
        path.write_text("left")
    stale_dir = tmp_path / ".entry.txt.ghi.partial"  # as a killed SmolLM2 conversion leaves its staging directory
    (stale_dir / "inner").mkdir(parents=True)
    hours_ago = time.time() - 2 * 3600
    for path in (stale, other, stale_dir):
        os.utime(path, (hours_ago, hours_ago))
    assets_mod.write_replacing(target, lambda partial: partial.write_text("whole"))
    # Other writers' fresh partial files stay, whatever entry they fill.
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["entry.txt", fresh.name, other_fresh.name])


def test_a_cached_clusterings_read_removes_what_a_killed_write_of_it_left(tmp_path, monkeypatch):
    # A finished entry is only read again: sweeping at writes alone kept a killed write's files for good.
    monkeypatch.setenv("FLASHHEAD_CACHE_DIR", str(tmp_path))
    emb = torch.randn(40, 6, generator=torch.Generator().manual_seed(9))
    _, assets = flash_head_for(emb, 4, iters=1, progress=False)
    entry = next((tmp_path / "clusters").iterdir())
    left = [entry / ".config.json.abc.partial", entry / assets_mod.DEFAULT_CACHE_DIR / ".clusters.safetensors.abc.partial"]
    hours_ago = time.time() - 2 * 3600
    for path in left:
        path.write_text("left")
        os.utime(path, (hours_ago, hours_ago))
    flash_head_for(emb, 4, iters=1, progress=False)
    assert not any(path.exists() for path in left)


def test_padded_clustering_round_trip(tmp_path):
    emb = torch.randn(99, 5, generator=torch.Generator().manual_seed(4))
    clustering = build_clusters(emb, 8, iters=2, progress=False)
    save_assets(tmp_path, clustering)
    loaded = load_assets(tmp_path, emb)
    assert loaded.enforce_equal_cluster_sizes is False
    assert loaded.n_probes == 1  # C/16 rounded down, at least 1
    assert torch.equal(loaded.cluster_tokens, clustering.cluster_tokens)
    head = loaded.head(emb, probes=loaded.num_clusters)
    hidden = torch.randn(4, 5, generator=torch.Generator().manual_seed(2))
    assert torch.equal(head.next_token(hidden), (hidden @ emb.T).argmax(1))


def _published(directory, centroids, assignments, config=None, cache_dir="flash_head_assets"):
    """A directory laid out as a published FlashHead checkpoint (model config.json carries the keys)."""
    (directory / cache_dir).mkdir(parents=True)
    save_file({"centroids": centroids.contiguous(), "cluster_assignments": assignments.contiguous()},
              str(directory / cache_dir / TENSORS_NAME))
    model_config = {"model_type": "llama", "hidden_size": DIM, "vocab_size": VOCAB, **(config or {})}
    (directory / "config.json").write_text(json.dumps(model_config))
    return directory


def test_loads_published_layout_with_leading_singleton_dims(tmp_path, embedding):
    count = VOCAB // SIZE
    assignments = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(3)) % count
    raw = torch.randn(count, DIM, generator=torch.Generator().manual_seed(6))
    _published(tmp_path, raw.T.reshape(1, DIM, count), assignments.reshape(1, VOCAB),
               {"flash_head_cache_dir": "fh", "n_clusters": count, "flash_head_special_token_ids": [0]}, cache_dir="fh")
    loaded = load_assets(tmp_path, embedding)
    assert loaded.cache_dir == "fh" and loaded.special_token_ids == [0]
    assert loaded.n_probes == max(1, count // 16)
    assert loaded.cluster_tokens.shape == (count, SIZE)
    for c in range(count):
        assert torch.equal(loaded.cluster_tokens[c].long(), (assignments == c).nonzero().flatten())
    assert torch.equal(loaded.raw_centroids, raw)
    # And what we save from it loads back identically.
    save_assets(tmp_path / "again", loaded)
    again = load_assets(tmp_path / "again", embedding)
    assert torch.equal(again.cluster_tokens, loaded.cluster_tokens) and torch.equal(again.raw_centroids, raw)


def test_our_config_file_wins_over_model_config(tmp_path, embedding, clustering):
    save_assets(tmp_path, clustering, n_probes=2)
    (tmp_path / "config.json").write_text(json.dumps({"n_probes": 5, "model_type": "llama"}))
    assert load_assets(tmp_path, embedding).n_probes == 2
    # Ours wins even when it holds no FlashHead key; the model's is read only where ours is absent.
    (tmp_path / CONFIG_NAME).write_text("{}")
    assert assets_mod.read_config(tmp_path) == {}
    (tmp_path / CONFIG_NAME).unlink()
    assert assets_mod.read_config(tmp_path) == {"n_probes": 5}


def test_probes_default_to_a_sixteenth_of_the_clusters_and_may_be_all(tmp_path):
    # 40 clusters: C/16 is 2 (C/8 would be 5; below 32 clusters both are 1).
    emb = torch.randn(160, 6, generator=torch.Generator().manual_seed(5))
    clustering = build_clusters(emb, 4, iters=1, progress=False)
    assert assets_mod.default_probes(40) == 2 and FlashHeadAssets.from_clustering(clustering).n_probes == 2
    save_assets(tmp_path, clustering)
    config = json.loads((tmp_path / CONFIG_NAME).read_text())
    del config["n_probes"]  # a published config without the key
    (tmp_path / CONFIG_NAME).write_text(json.dumps(config))
    assert load_assets(tmp_path, emb).n_probes == 2
    # Every cluster probed is a valid setting, and gives the dense head's token.
    save_assets(tmp_path, clustering, n_probes=40)
    loaded = load_assets(tmp_path, emb)
    assert loaded.n_probes == 40
    hidden = torch.randn(7, 6, generator=torch.Generator().manual_seed(6))
    assert torch.equal(loaded.head(emb).next_token(hidden), (hidden @ emb.T).argmax(1))


def _write_bad(directory, *, centroids=None, assignments=None, config=None, drop=None):
    count = VOCAB // SIZE
    tensors = {
        "centroids": torch.randn(DIM, count) if centroids is None else centroids,
        "cluster_assignments": torch.arange(VOCAB) % count if assignments is None else assignments,
    }
    if drop:
        del tensors[drop]
    (directory / "flash_head_assets").mkdir(parents=True)
    save_file(tensors, str(directory / "flash_head_assets" / TENSORS_NAME))
    (directory / CONFIG_NAME).write_text(json.dumps(config or {}))


@pytest.mark.parametrize("bad,match", [
    ({"drop": "centroids"}, "has no tensor 'centroids'"),
    ({"drop": "cluster_assignments"}, "has no tensor 'cluster_assignments'"),
    ({"assignments": torch.cat([torch.zeros(2, dtype=torch.int64), torch.arange(VOCAB - 2) % 12])},
     "cluster sizes range from 7 .* to 10 .*same number of tokens"),
    ({"assignments": torch.arange(VOCAB) % 13}, r"cluster_assignments\[12\] = 12 is not a cluster id in \[0, 12\)"),
    ({"assignments": torch.arange(VOCAB) % 12 - 1}, r"cluster_assignments\[0\] = -1 is not a cluster id"),
    ({"assignments": torch.arange(VOCAB) % 11, "config": {"enforce_equal_cluster_sizes": False}}, "cluster 11 has no tokens"),
    ({"assignments": (torch.arange(VOCAB) % 12).float()}, "must hold integer cluster ids"),
    ({"centroids": torch.randn(DIM, 12, 2)}, r"centroids .* must have shape \[hidden, clusters\], got \(12, 12, 2\)"),
    ({"config": {"n_clusters": 10}}, "config says n_clusters=10 but centroids .* have 12 clusters"),
    ({"config": {"n_probes": 13}}, r"n_probes must be an int in 1..12"),
    ({"config": {"flash_head_greedy_scoring": "unit"}}, r"flash_head_greedy_scoring must be one of \('normalized', 'raw'\)"),
    ({"config": {"flash_head_special_token_ids": [VOCAB]}}, r"flash_head_special_token_ids must be a list of token ids in \[0, 96\)"),
    ({"centroids": torch.randn(DIM + 1, 12)}, "centroids of hidden size 13 but the embedding has hidden size 12"),
    ({"centroids": torch.randn(16, DIM), "assignments": torch.arange(VOCAB) % 16},
     r"have shape \(16, 12\) but cluster_assignments use 16 cluster ids: the centroids look transposed"),
    ({"centroids": torch.randn(8, DIM), "assignments": torch.arange(VOCAB) % 8},  # fewer clusters than DIM
     r"have shape \(8, 12\) but cluster_assignments use 8 cluster ids: the centroids look transposed"),
    ({"centroids": torch.randn(DIM, 24), "assignments": torch.arange(VOCAB) % 12,
      "config": {"enforce_equal_cluster_sizes": False}}, "cluster 12 has no tokens"),  # not transposed
    ({"assignments": torch.arange(VOCAB + 12) % 12}, "assign 108 tokens .* but the embedding has vocab size 96"),
    ({"centroids": torch.randn(DIM, 12).index_fill_(1, torch.tensor([5]), float("nan"))},
     r"centroids in .* hold NaN or infinite values"),
    ({"centroids": torch.randn(DIM, 12, dtype=torch.float64).index_fill_(1, torch.tensor([5]), 1e300)},
     r"centroids in .* hold NaN or infinite values \(as float32, as they are kept\)"),  # refused by FlashHead, later
    *[({"config": {"flash_head_cache_dir": bad}}, rf"flash_head_cache_dir must be a directory name \(a string\), got {re.escape(repr(bad))}")
      for bad in (None, 3, ["flash_head_assets"])],
    *[({"config": {"enforce_equal_cluster_sizes": bad}}, rf"enforce_equal_cluster_sizes must be true or false, got {re.escape(repr(bad))}")
      for bad in (None, "false", 0)],
    *[({"config": {"flash_head_cache_dir": bad}}, "flash_head_cache_dir must be a directory inside the assets directory")
      for bad in ("..", "../flash_head_assets", "/tmp", "a/../..")],
    *[({"config": {"flash_head_special_token_ids": bad}}, "flash_head_special_token_ids must be a list of token ids")
      for bad in (0, False, "", {})],  # read as no special tokens before
    ({"config": {"n_clusters": "12"}}, "config says n_clusters='12' but centroids"),
    ({"centroids": torch.randn(DIM, 0), "config": {"enforce_equal_cluster_sizes": False}}, r"hold no clustering: centroids \(12, 0\)"),
])
def test_malformed_assets_raise_clear_errors(tmp_path, embedding, bad, match):
    _write_bad(tmp_path, **bad)
    with pytest.raises(ValueError, match=match):
        load_assets(tmp_path, embedding)


def test_loaded_assets_do_not_follow_their_files_written_over_in_place(tmp_path, embedding, clustering):
    # A copy over the files (rsync, a shared cache refreshed elsewhere) changes them in place: memory-
    # mapped tensors would change with them, or kill the process once the file is truncated.
    save_assets(tmp_path, clustering, n_probes=2)
    loaded = load_assets(tmp_path, embedding)
    saved = copy.deepcopy(loaded)
    tensors = tmp_path / "flash_head_assets" / TENSORS_NAME
    other = FlashHeadAssets.from_clustering(build_clusters(embedding.flip(0), SIZE, iters=2, progress=False))
    save_assets(tmp_path / "other", other)
    (tmp_path / CONFIG_NAME).write_bytes((tmp_path / "other" / CONFIG_NAME).read_bytes())
    with open(tensors, "r+b") as f:  # the same size, other values, in place
        f.write((tmp_path / "other" / "flash_head_assets" / TENSORS_NAME).read_bytes())
    assert not torch.equal(load_assets(tmp_path, embedding).cluster_assignments, saved.cluster_assignments)  # the file changed
    assert torch.equal(loaded.cluster_assignments, saved.cluster_assignments)  # what was loaded did not
    assert torch.equal(loaded.raw_centroids, saved.raw_centroids)


def test_a_config_loads_only_with_the_tensors_it_was_saved_with(tmp_path, embedding, clustering, monkeypatch):
    # A save over other assets killed between its two files' renames left the new tensors under the
    # old config (its settings and fingerprint), which loaded without a word.
    save_assets(tmp_path, clustering, n_probes=2)
    other = FlashHeadAssets.from_clustering(build_clusters(embedding.flip(0), SIZE, iters=2, progress=False))
    real_write = assets_mod.write_replacing

    def killed_before_the_config(path, write):
        if path.name == CONFIG_NAME:
            raise KeyboardInterrupt
        real_write(path, write)

    monkeypatch.setattr(assets_mod, "write_replacing", killed_before_the_config)
    with pytest.raises(KeyboardInterrupt):
        save_assets(tmp_path, other)
    monkeypatch.undo()
    tensors = tmp_path / "flash_head_assets" / TENSORS_NAME
    with pytest.raises(ValueError, match=f"{re.escape(str(tensors))} is not the tensors file its config was saved with"):
        load_assets(tmp_path, embedding)
    save_assets(tmp_path, other)  # saved again, whole
    assert torch.equal(load_assets(tmp_path, embedding).cluster_assignments, other.cluster_assignments)
    # Configs saved before the digest, and published ones, have none: their tensors load as they are.
    config = json.loads((tmp_path / CONFIG_NAME).read_text())
    del config["flash_head_tensors_sha256"]
    (tmp_path / CONFIG_NAME).write_text(json.dumps(config))
    assert torch.equal(load_assets(tmp_path, embedding).cluster_assignments, other.cluster_assignments)
    for malformed in ("ABC", 7, "0" * 63):
        (tmp_path / CONFIG_NAME).write_text(json.dumps(dict(config, flash_head_tensors_sha256=malformed)))
        with pytest.raises(ValueError, match="flash_head_tensors_sha256 must be a sha256 hex digest"):
            load_assets(tmp_path, embedding)


def test_unreadable_files_are_named(tmp_path, embedding):
    _write_bad(tmp_path)
    tensors = tmp_path / "flash_head_assets" / TENSORS_NAME
    tensors.write_bytes(tensors.read_bytes()[:100])  # a truncated copy
    with pytest.raises(ValueError, match=f"{re.escape(str(tensors))} is not a readable safetensors file"):
        load_assets(tmp_path, embedding)
    for text, match in (("{not json", "is not a JSON file"), ("[1, 2]", "must hold a JSON object, got list")):
        (tmp_path / CONFIG_NAME).write_text(text)
        with pytest.raises(ValueError, match=f"{re.escape(str(tmp_path / CONFIG_NAME))} {match}"):
            load_assets(tmp_path, embedding)


def test_missing_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_assets(tmp_path / "nowhere")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(NotADirectoryError, match=f"FlashHead assets directory {re.escape(str(tmp_path / 'config.json'))} is a file"):
        load_assets(tmp_path / "config.json")
    (tmp_path / CONFIG_NAME).write_text(json.dumps({"flash_head_cache_dir": "elsewhere"}))
    with pytest.raises(FileNotFoundError, match=r"elsewhere/clustering_cache.safetensors .*flash_head_cache_dir='elsewhere'"):
        load_assets(tmp_path)


def test_head_checks_the_embedding(embedding, clustering):
    assets = FlashHeadAssets.from_clustering(clustering)
    with pytest.raises(ValueError, match="hidden size 12 but the embedding has hidden size 11"):
        assets.head(embedding[:, :11])
    with pytest.raises(TypeError, match="embedding must be a torch.Tensor"):
        assets.head(embedding.numpy())
    with pytest.raises(ValueError, match=r"embedding must be 2-D \[vocab_size, hidden_dim\], got shape \(96, 12, 1\)"):
        assets.head(embedding.unsqueeze(-1))


def test_flash_head_for_checks_the_embedding_before_clustering(monkeypatch, embedding):
    monkeypatch.setattr(assets_mod, "build_clusters", lambda *a, **k: pytest.fail("clustered a bad embedding"))
    for bad, error, match in ((embedding.tolist(), TypeError, "embedding must be a torch.Tensor"),
                              (embedding.double(), TypeError, "embedding must be float16, bfloat16 or float32"),
                              (embedding[0], ValueError, "embedding must be a non-empty 2-D tensor"),
                              (embedding.to("meta"), ValueError, "embedding is on the meta device")):
        with pytest.raises(error, match=match):
            flash_head_for(bad, SIZE, iters=1, cache=False, progress=False)
    # The calibration states too, before the cache key's digest reads them.
    for bad, error, match in ((embedding.tolist(), TypeError, "hidden must be a torch.Tensor"),
                              (embedding.to("meta"), ValueError, "hidden is on the meta device"),
                              (embedding[:, :3], ValueError, "hidden must have the embedding's hidden size")):
        with pytest.raises(error, match=match):
            flash_head_for(embedding, SIZE, hidden=bad, iters=1, progress=False)


def test_flash_head_for_caches_the_clustering(tmp_path, monkeypatch, embedding):
    monkeypatch.setenv("FLASHHEAD_CACHE_DIR", str(tmp_path))
    head, first = flash_head_for(embedding, SIZE, probes=2, iters=2, progress=False)
    assert head.probes == 2 and head.num_clusters == VOCAB // SIZE
    assert first.n_probes == 2  # the returned assets describe this head: save_assets keeps its probes
    assert len(list((tmp_path / "clusters").iterdir())) == 1

    def no_rebuild(*args, **kwargs):
        raise AssertionError("a cached clustering must not be rebuilt")

    monkeypatch.setattr(assets_mod, "build_clusters", no_rebuild)
    head2, second = flash_head_for(embedding, SIZE, special_token_ids=[7], iters=2, progress=False)
    assert torch.equal(second.cluster_tokens, first.cluster_tokens)
    assert torch.equal(second.raw_centroids, first.raw_centroids)
    assert head2.probes == second.n_probes != 2 and head2.extra_ids.tolist() == [7]  # the cache kept its default
    with pytest.raises(AssertionError, match="must not be rebuilt"):
        flash_head_for(embedding, SIZE, iters=2, cache=False, progress=False)
    # A different embedding is a different cache entry.
    with pytest.raises(AssertionError, match="must not be rebuilt"):
        flash_head_for(embedding * 2, SIZE, iters=2, progress=False)


def test_a_cache_hit_takes_the_entrys_row_projections(tmp_path, monkeypatch, embedding):
    monkeypatch.setenv("FLASHHEAD_CACHE_DIR", str(tmp_path))
    _, built = flash_head_for(embedding, SIZE, iters=2, progress=False)
    assert torch.equal(built.row_projections, assets_mod.embedding_row_projections(embedding))
    # The entry's name is the embedding's digest, so its projections are this embedding's: reading
    # every row again (most of a hit's time on a large head) would give the same values. An entry
    # without them gets them (test_a_cache_entry_saved_before_row_projections_gets_them).
    monkeypatch.setattr(assets_mod, "embedding_row_projections", lambda *a: pytest.fail("computed the entry's projections"))
    _, hit = flash_head_for(embedding, SIZE, iters=2, progress=False)
    assert torch.equal(hit.row_projections, built.row_projections)


def test_flash_head_for_caches_each_seed_apart(tmp_path, monkeypatch, embedding):
    monkeypatch.setenv("FLASHHEAD_CACHE_DIR", str(tmp_path))
    _, first = flash_head_for(embedding, SIZE, seed=0, iters=2, progress=False)
    _, second = flash_head_for(embedding, SIZE, seed=1, iters=2, progress=False)
    expected = build_clusters(embedding, SIZE, iters=2, seed=1, progress=False)
    assert not torch.equal(first.cluster_tokens, expected.cluster_tokens)  # the seeds cluster differently
    assert torch.equal(second.cluster_tokens, expected.cluster_tokens)


def test_flash_head_for_checks_finiteness_where_it_clusters_not_on_a_cache_hit(tmp_path, monkeypatch, embedding):
    monkeypatch.setenv("FLASHHEAD_CACHE_DIR", str(tmp_path))
    hidden = _hidden(37)
    for states in (None, hidden):
        flash_head_for(embedding, SIZE, hidden=states, iters=2, progress=False)  # built: checked
    checked = []
    isfinite = torch.isfinite
    monkeypatch.setattr(torch, "isfinite", lambda tensor: checked.append(tensor) or isfinite(tensor))
    for states in (None, hidden):
        flash_head_for(embedding, SIZE, hidden=states, iters=2, progress=False)  # cache hits
    assert not any(tensor is embedding or tensor is hidden for tensor in checked)  # the values that were checked when built
    # A miss still refuses values the clustering cannot take.
    nan_row, inf_state = embedding.clone(), hidden.clone()
    nan_row[5, 3], inf_state[7, 2] = float("nan"), float("inf")
    with pytest.raises(ValueError, match="embedding holds NaN or infinite values"):
        flash_head_for(nan_row, SIZE, iters=2, progress=False)
    with pytest.raises(ValueError, match="hidden holds NaN or infinite values"):
        flash_head_for(embedding, SIZE, hidden=inf_state, iters=2, progress=False)


@pytest.mark.parametrize("settings,error,fragment", [(dict(cluster_size="8"), TypeError, "cluster_size must be an int"),
                                                      (dict(cluster_size=10**6), ValueError, "cluster_size must be in 1.."),
                                                      (dict(iters=0), ValueError, "iters must be >= 1"),
                                                      (dict(seed=-2**64), ValueError, "seed must be in")])
def test_flash_head_for_checks_the_settings_its_key_names_on_a_cache_hit_too(tmp_path, monkeypatch, embedding, settings,
                                                                             error, fragment):
    monkeypatch.setenv("FLASHHEAD_CACHE_DIR", str(tmp_path))
    flash_head_for(embedding, SIZE, iters=2, progress=False)
    (built,) = (tmp_path / "clusters").iterdir()
    asked = {**dict(cluster_size=SIZE, iters=2, seed=0), **settings}
    # Renamed to the key the refused call names: without the checks it would be a cache hit.
    built.rename(built.with_name(built.name.replace(f"-b{SIZE}-i2-s0", "-b{cluster_size}-i{iters}-s{seed}".format(**asked))))
    with pytest.raises(error, match=fragment):
        flash_head_for(embedding, progress=False, **asked)


@pytest.mark.parametrize("probes,error,fragment", [(0, ValueError, "probes must be in 1..12 \\(the number of clusters\\), got 0"),
                                                    (2.0, TypeError, "probes must be a Python int"),
                                                    (VOCAB // SIZE + 1, ValueError,
                                                     f"probes must be in 1..{VOCAB // SIZE} \\(the number of clusters\\), got 13")])
def test_flash_head_for_checks_probes_before_clustering(tmp_path, monkeypatch, embedding, probes, error, fragment):
    monkeypatch.setenv("FLASHHEAD_CACHE_DIR", str(tmp_path))

    def no_clustering(*args, **kwargs):
        raise AssertionError("probes must be checked before minutes of clustering")

    monkeypatch.setattr(assets_mod, "build_clusters", no_clustering)
    with pytest.raises(error, match=fragment):
        flash_head_for(embedding, SIZE, probes=probes, iters=2, progress=False)
    assert not (tmp_path / "clusters").exists()


def test_calibrated_clustering_round_trip_keeps_raw_greedy_scoring(tmp_path, embedding):
    calibrated = calibrate_clusters(embedding, _hidden(40), SIZE, iters=2, progress=False)
    save_assets(tmp_path, calibrated, n_probes=2)
    assert json.loads((tmp_path / CONFIG_NAME).read_text())["flash_head_greedy_scoring"] == "raw"
    loaded = load_assets(tmp_path, embedding)
    assert loaded.greedy_scoring == "raw" and torch.equal(loaded.centroids, calibrated.raw_centroids)
    head = loaded.head(embedding)
    # Fitted centroids are ranked as they are for greedy decoding, and sampled raw as always.
    assert torch.equal(head.centroids, calibrated.raw_centroids) and torch.equal(head.sampling_centroids, calibrated.raw_centroids)
    best = (_hidden() @ calibrated.raw_centroids.T).argmax(1)
    candidates = loaded.head(embedding, probes=1).candidate_logits(_hidden())[0]
    assert torch.equal(candidates.sort(1).values, calibrated.cluster_tokens[best].sort(1).values)


def test_flash_head_for_keeps_methods_apart_in_the_cache(tmp_path, monkeypatch, embedding):
    monkeypatch.setenv("FLASHHEAD_CACHE_DIR", str(tmp_path))
    _, plain = flash_head_for(embedding, SIZE, iters=2, progress=False)
    _, calibrated = flash_head_for(embedding, SIZE, hidden=_hidden(36), iters=2, progress=False)
    assert (plain.greedy_scoring, calibrated.greedy_scoring) == ("normalized", "raw")
    assert len(list((tmp_path / "clusters").iterdir())) == 2

    def no_rebuild(*args, **kwargs):
        raise AssertionError("a cached clustering must not be rebuilt")

    monkeypatch.setattr(assets_mod, "build_clusters", no_rebuild)
    monkeypatch.setattr(assets_mod, "calibrate_clusters", no_rebuild)
    assert flash_head_for(embedding, SIZE, iters=2, progress=False)[1].greedy_scoring == "normalized"
    again = flash_head_for(embedding, SIZE, hidden=_hidden(36), iters=2, progress=False)[1]
    assert torch.equal(again.raw_centroids, calibrated.raw_centroids)
    # Other calibration states are another clustering.
    with pytest.raises(AssertionError, match="must not be rebuilt"):
        flash_head_for(embedding, SIZE, hidden=_hidden(37), iters=2, progress=False)


def test_files_written_get_the_umask_s_mode_not_their_owner_s_alone(tmp_path, clustering):
    # mkstemp's partial files are 0600: renamed as they were, a model directory's assets or a team's
    # shared cache could not be read by other users.
    old = os.umask(0o022)
    try:
        assert stat.S_IMODE(assets_mod.new_partial(tmp_path, ".d.", is_dir=True).stat().st_mode) == 0o755
        save_assets(tmp_path, clustering)
        assert stat.S_IMODE((tmp_path / CONFIG_NAME).stat().st_mode) == 0o644
        assert stat.S_IMODE((tmp_path / "flash_head_assets" / TENSORS_NAME).stat().st_mode) == 0o644
        os.umask(0o077)
        save_assets(tmp_path, clustering)
        assert stat.S_IMODE((tmp_path / CONFIG_NAME).stat().st_mode) == 0o600
    finally:
        os.umask(old)


def test_a_cache_that_cannot_be_written_warns_and_the_clustering_is_kept(tmp_path, monkeypatch, embedding):
    blocked = tmp_path / "not_a_directory"
    blocked.write_text("")
    monkeypatch.setenv("FLASHHEAD_CACHE_DIR", str(blocked))
    with pytest.warns(RuntimeWarning, match=f"the clustering could not be cached under {re.escape(str(blocked))} .*FLASHHEAD_CACHE_DIR"):
        head, assets = flash_head_for(embedding, SIZE, iters=2, progress=False)
    reference = FlashHeadAssets.from_clustering(build_clusters(embedding, SIZE, iters=2, progress=False))
    assert torch.equal(assets.cluster_tokens, reference.cluster_tokens) and head.num_clusters == VOCAB // SIZE
    assert blocked.read_text() == ""


def test_a_damaged_cache_entry_is_built_again(tmp_path, monkeypatch, embedding):
    monkeypatch.setenv("FLASHHEAD_CACHE_DIR", str(tmp_path))
    _, first = flash_head_for(embedding, SIZE, iters=2, progress=False)
    (entry,) = (tmp_path / "clusters").iterdir()
    tensors = entry / "flash_head_assets" / TENSORS_NAME
    tensors.write_bytes(tensors.read_bytes()[:50])  # a copy cut short
    with pytest.warns(RuntimeWarning, match=f"the cached clustering at {re.escape(str(entry))} is unreadable"):
        _, again = flash_head_for(embedding, SIZE, iters=2, progress=False)
    assert torch.equal(again.cluster_tokens, first.cluster_tokens)
    assert torch.equal(load_assets(entry, embedding).raw_centroids, first.raw_centroids)  # the entry is whole again


def test_a_cache_entry_that_is_not_what_its_name_says_is_built_again(tmp_path, monkeypatch, embedding):
    # An entry copied or synced in from elsewhere: another embedding's clustering, or another cluster
    # size's, under this one's name. It was taken as it was, and recorded this embedding's fingerprint.
    monkeypatch.setenv("FLASHHEAD_CACHE_DIR", str(tmp_path / "cache"))
    _, want = flash_head_for(embedding, SIZE, iters=2, progress=False)
    (entry,) = (tmp_path / "cache" / "clusters").iterdir()
    other = embedding.flip(1) * 2
    for wrong, reason in ((flash_head_for(other, SIZE, iters=2, progress=False, cache=False)[1],
                           r"it was built for other output weights: sampled rows differ by \d+% of their scale"),
                          (build_clusters(embedding, SIZE // 2, iters=2, progress=False),
                           rf"it holds {2 * VOCAB // SIZE} clusters, not the {VOCAB // SIZE} of its cluster size"),
                          # Same vocabulary and cluster sizes and no fingerprint to tell (saved without one):
                          # only its hidden size shows it, else the head built over it failed.
                          (build_clusters(embedding[:, :DIM - 3].contiguous(), SIZE, iters=2, progress=False),
                           f"assets have centroids of hidden size {DIM - 3} but the embedding has hidden size {DIM}")):
        save_assets(entry, wrong) if isinstance(wrong, FlashHeadAssets) else save_assets(entry, wrong, n_probes=2)
        with pytest.warns(RuntimeWarning, match=f"the cached clustering at {re.escape(str(entry))} is unreadable or "
                                                f"not what its name says \\({reason}\\); building it again"):
            head, again = flash_head_for(embedding, SIZE, iters=2, progress=False)
        assert torch.equal(again.cluster_tokens, want.cluster_tokens) and head.cluster_tokens.shape[1] == SIZE
        assert load_assets(entry).embedding_fingerprint == assets_mod.embedding_fingerprint(embedding)  # the entry is right again


def test_a_cache_dir_given_with_a_tilde_is_expanded(tmp_path, monkeypatch, embedding, clustering):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("FLASHHEAD_CACHE_DIR", "~/fh")
    assert assets_mod.user_cache_dir() == tmp_path / "fh"
    # And so is an assets directory, as the cache's is.
    assert save_assets("~/saved", clustering) == tmp_path / "saved"
    assert torch.equal(load_assets("~/saved", embedding).cluster_tokens, clustering.cluster_tokens)


def test_a_config_that_is_a_directory_is_refused(tmp_path, embedding):
    # The defaults (n_probes C/16, no special tokens) were read in its place without a word.
    _write_bad(tmp_path, config={"n_probes": 2})
    (tmp_path / CONFIG_NAME).unlink()
    (tmp_path / CONFIG_NAME).mkdir()
    with pytest.raises(ValueError, match=f"{re.escape(str(tmp_path / CONFIG_NAME))} must be a file, not a directory"):
        load_assets(tmp_path, embedding)


def test_loading_a_clustering_for_other_weights_warns(tmp_path, monkeypatch, embedding):
    monkeypatch.setenv("FLASHHEAD_CACHE_DIR", str(tmp_path / "cache"))
    _, assets = flash_head_for(embedding, SIZE, iters=2, progress=False)
    assert assets.embedding_fingerprint == assets_mod.embedding_fingerprint(embedding)
    save_assets(tmp_path / "saved", assets)
    config = json.loads((tmp_path / "saved" / CONFIG_NAME).read_text())
    assert len(config["flash_head_embedding_fingerprint"]) == 256
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for cast in (embedding, embedding.bfloat16(), embedding.half()):  # the same weights in another dtype
            assert load_assets(tmp_path / "saved", cast).embedding_fingerprint == config["flash_head_embedding_fingerprint"]
        load_assets(tmp_path / "saved")  # nothing to compare with
    noise = torch.randn(embedding.shape, generator=torch.Generator().manual_seed(9))
    for other in (noise, embedding + 0.1 * noise):  # another model's weights, or fine-tuned ones
        with pytest.warns(UserWarning, match=f"clustering in {re.escape(str(tmp_path / 'saved'))}.* was built for other "
                                             "output weights than these"):
            load_assets(tmp_path / "saved", other)
        # So does a head built from the assets for them (they hold the fingerprint), and only that.
        with pytest.warns(UserWarning, match="clustering in these assets was built for other output weights") as record:
            assets.head(other)
        assert len(record) == 1 and record[0].filename == __file__
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assets.head(embedding.bfloat16())
        flash_head_for(embedding, SIZE, iters=2, progress=False)  # from the cache
    # One that holds zeros only says how far other weights are in words, not in a 30-digit percentage.
    config["flash_head_embedding_fingerprint"] = [0.0] * 256
    (tmp_path / "saved" / CONFIG_NAME).write_text(json.dumps(config))
    with pytest.warns(UserWarning, match=r"sampled rows differ by more than 1000% of their scale"):
        load_assets(tmp_path / "saved", embedding)
    # Published checkpoints carry no fingerprint; a malformed one is named.
    # NaN, inf (JSON writes both) or a bool at the right length too: NaN made every weight look other.
    for malformed in ([1.0, float("nan")], [1.0] * 257, [1.0] * 255 + [float("nan")], [1.0] * 255 + [float("inf")],
                      [1.0] * 255 + [True]):
        config["flash_head_embedding_fingerprint"] = malformed
        (tmp_path / "saved" / CONFIG_NAME).write_text(json.dumps(config))
        with pytest.raises(ValueError, match="flash_head_embedding_fingerprint must be a list of 256 finite numbers"):
            load_assets(tmp_path / "saved", embedding)


def test_fingerprints_keep_the_values_configs_saved_before_hold():
    # A fingerprint is saved in configs: its rows, directions and rounding are a file format, and a
    # change to any of them made every clustering saved before warn for its own weights.
    weights = torch.sin(torch.arange(97 * 5, dtype=torch.float64)).reshape(97, 5).float()  # no random stream
    fingerprint = assets_mod.embedding_fingerprint(weights)
    assert len(fingerprint) == 256
    assert [fingerprint[i] for i in (0, 1, 2, 3, 129, 254, 255)] == pytest.approx(
        [0.013056, 0.613742, -0.681464, 0.3318, 0.652933, 1.07957, 1.17321], abs=2e-5)


def _drop_row_projections(directory: Path) -> None:
    """Makes the assets at ``directory`` as saved before the rows were recorded (no digest to update)."""
    path = directory / "flash_head_assets" / TENSORS_NAME
    stored = load_file(str(path))
    del stored["embedding_row_projections"]
    save_file(stored, str(path))
    config = json.loads((directory / CONFIG_NAME).read_text())
    del config["flash_head_tensors_sha256"]
    (directory / CONFIG_NAME).write_text(json.dumps(config))


def _llama3_like(seed: int, vocab: int = 389, dim: int = 40) -> torch.Tensor:
    """An embedding with Llama-3's kinds of rows: some set to the mean row (reserved tokens), some near
    zero (float16 flushes them to subnormals), some large."""
    generator = torch.Generator().manual_seed(seed)
    weights = torch.randn(vocab, dim, generator=generator) * 0.02
    weights[-23:] = weights[:-23].mean(0)
    weights[5:9] *= 1e-4
    weights[11] *= 300
    return weights


def test_a_fine_tune_of_a_few_rows_warns_and_casts_do_not(tmp_path, monkeypatch):
    # New tokens trained into reserved rows: the 64 sampled rows are not among them, and the
    # clustering was loaded without a word. Each row's projections are compared against what a
    # cast can move them by.
    monkeypatch.setenv("FLASHHEAD_CACHE_DIR", str(tmp_path / "cache"))
    weights = _llama3_like(41)
    vocab = weights.shape[0]
    sampled = set((torch.arange(assets_mod.FINGERPRINT_ROWS) * 2654435761 % vocab).tolist())
    trained = [row for row in range(vocab - 23, vocab) if row not in sampled][:2]
    for built_from in (weights, weights.bfloat16(), weights.half()):
        _, assets = flash_head_for(built_from, SIZE, iters=2, progress=False)
        assert assets.row_projections.shape == (vocab, 4) and assets.row_projections.dtype == torch.float32
        save_assets(tmp_path / "saved", assets)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for cast in (weights, weights.bfloat16(), weights.half(), weights.half().bfloat16(), weights.double()):
                load_assets(tmp_path / "saved", cast)
                assets.head(cast.float() if cast.dtype == torch.float64 else cast)
        tuned = built_from.float().clone()
        tuned[trained] = tuned[trained] + 0.3 * tuned[trained].norm(dim=1, keepdim=True) * torch.randn(
            2, weights.shape[1], generator=torch.Generator().manual_seed(5)) / weights.shape[1] ** 0.5
        tuned = tuned.to(built_from.dtype)
        assert assets_mod.fingerprint_change(assets.embedding_fingerprint, assets_mod.embedding_fingerprint(tuned)) == 0
        shown = ", ".join(map(str, trained))
        message = f"built for other output weights than these \\(2 of their {vocab} rows differ by more than a cast's rounding: {shown};"
        with pytest.warns(UserWarning, match=message) as record:
            load_assets(tmp_path / "saved", tuned)
        assert len(record) == 1 and record[0].filename == __file__
        with pytest.warns(UserWarning, match=message):
            assets.head(tuned)
    # Assets saved before the rows were recorded load as they did: the fingerprint alone, blind to it.
    _drop_row_projections(tmp_path / "saved")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_assets(tmp_path / "saved", tuned).row_projections is None


def test_a_cache_entry_saved_before_row_projections_gets_them(tmp_path, monkeypatch, embedding):
    # The entry's name is this embedding's digest, so its rows are recorded on the hit: without them
    # a later fine-tune of a few rows went unseen by the head built from the cached clustering.
    monkeypatch.setenv("FLASHHEAD_CACHE_DIR", str(tmp_path))
    flash_head_for(embedding, SIZE, iters=2, progress=False)
    (entry,) = (tmp_path / "clusters").iterdir()
    _drop_row_projections(entry)
    assert load_assets(entry).row_projections is None
    _, assets = flash_head_for(embedding, SIZE, iters=2, progress=False)
    assert assets.records_weights and torch.equal(assets.row_projections, assets_mod.embedding_row_projections(embedding))
    assert dataclasses.replace(assets, embedding_fingerprint=None).records_weights  # the rows alone record them too


def test_a_warning_names_the_first_eight_changed_rows_and_counts_them_all(tmp_path, monkeypatch, embedding):
    # Rows outside the fingerprint's 64, so the row comparison speaks; "..." tells that more follow.
    monkeypatch.setenv("FLASHHEAD_CACHE_DIR", str(tmp_path))
    _, assets = flash_head_for(embedding, SIZE, iters=2, progress=False)
    sampled = set((torch.arange(assets_mod.FINGERPRINT_ROWS) * 2654435761 % VOCAB).tolist())
    rows = sorted(set(range(VOCAB)) - sampled)[:9]
    first_eight = ", ".join(map(str, rows[:8]))
    for count, shown in ((8, f"{first_eight};"), (9, f"{first_eight}, ...;")):
        tuned = embedding.clone()
        tuned[rows[:count]] += 0.5
        with pytest.warns(UserWarning, match=re.escape(f"({count} of their {VOCAB} rows differ by more than a cast's "
                                                       f"rounding: {shown} tokens")):
            assets.head(tuned)


def test_a_row_that_is_not_finite_any_more_warns(tmp_path, monkeypatch, embedding):
    # float16 overflows to inf; NaN compares false with every bound.
    monkeypatch.setenv("FLASHHEAD_CACHE_DIR", str(tmp_path / "cache"))
    _, assets = flash_head_for(embedding, SIZE, iters=2, progress=False)
    sampled = set((torch.arange(assets_mod.FINGERPRINT_ROWS) * 2654435761 % VOCAB).tolist())
    row = max(set(range(VOCAB)) - sampled)
    for bad in (float("inf"), float("nan")):
        broken = embedding.clone()
        broken[row, 3] = bad
        with pytest.warns(UserWarning, match=f"1 of their {VOCAB} rows differ by more than a cast's rounding: {row};"):
            assets.head(broken)


def test_a_nan_in_a_sampled_row_warns_without_row_projections(tmp_path, monkeypatch, embedding):
    # Assets saved before the rows were recorded: the fingerprint's change was NaN, under no tolerance.
    monkeypatch.setenv("FLASHHEAD_CACHE_DIR", str(tmp_path / "cache"))
    _, assets = flash_head_for(embedding, SIZE, iters=2, progress=False)
    broken = embedding.clone()
    broken[0, 5] = float("nan")  # row 0 is the fingerprint's first
    with pytest.warns(UserWarning, match="sampled rows differ by more than 1000% of their scale"):
        dataclasses.replace(assets, row_projections=None).head(broken)


@pytest.mark.parametrize("slice_values", [1, DIM * 7 + 5, 1 << 21])
def test_rows_are_projected_and_compared_a_slice_at_a_time(monkeypatch, slice_values):
    # Slices keep the float64 copy small; every row is projected once, at its own index.
    weights = _llama3_like(43)
    whole = (weights.double() @ assets_mod._fingerprint_directions(weights.shape[1]).double()).float()
    monkeypatch.setattr(assets_mod, "ROW_SLICE_VALUES", slice_values)
    assert torch.equal(assets_mod.embedding_row_projections(weights), whole)
    # A slice holds at most ROW_SLICE_VALUES values (one row where a row holds more).
    assert max(rows.numel() for _, rows in assets_mod._row_slices(weights)) <= max(slice_values, weights.shape[1])
    tuned = weights.clone()
    tuned[[0, 17, 200, weights.shape[0] - 1]] += 0.01
    assert assets_mod.changed_rows(whole, tuned).tolist() == [0, 17, 200, weights.shape[0] - 1]
    assert assets_mod.changed_rows(whole, weights.bfloat16()).numel() == 0


def test_the_worst_roundings_a_cast_can_make_stay_within_the_bound():
    # Rows whose every weight a cast rounds by the most it can, each toward the same end of the
    # projection (the sign of its direction): rounded twice, float32 to float16 to bfloat16, a value
    # just above a power of two loses 2^-8 + 2^-12 of itself, past bfloat16's own 2^-8; a float16
    # subnormal loses up to half its spacing, 2^-25, whatever its size.
    dim = 53
    signs = assets_mod._fingerprint_directions(dim).sign()
    scales = 2.0 ** torch.randint(-6, 3, (dim,), generator=torch.Generator().manual_seed(3)).float()
    rows = torch.stack([signs[:, column] * scales * (1 + 2.0 ** -8 + 2.0 ** -12 - 2.0 ** -20) for column in range(4)]
                       + [signs[:, column] * 2.0 ** -24 * (1 + 0.49 * (column + 1) / 4) for column in range(4)])
    stored = assets_mod.embedding_row_projections(rows)
    for cast in (rows.half().bfloat16(), rows.half()):
        assert (cast.float() != rows).all()
        assert assets_mod.changed_rows(stored, cast).numel() == 0
    # Moved by a few spacings more, they are changed.
    assert assets_mod.changed_rows(stored, rows * (1 - 2.0 ** -5)).tolist() == list(range(4))
    # Built from a bfloat16 cast, compared with the double rounding: the two casts a whole bfloat16
    # spacing apart (the first rounds up, the second ties to even, down), which uses the doubled
    # bound up, and the stored float32's rounding of projections past 1 comes on top of it.
    powers = 2.0 ** torch.randint(0, 6, (4, dim), generator=torch.Generator().manual_seed(4)).float()
    ties = signs.T * powers * (1 + 2.0 ** -8 + 2.0 ** -14)
    assert torch.equal((ties.bfloat16().float() - ties.half().bfloat16().float()).abs(), powers * 2.0 ** -7)
    assert assets_mod.changed_rows(assets_mod.embedding_row_projections(ties.bfloat16()), ties.half().bfloat16()).numel() == 0


@pytest.mark.gpu
def test_rows_of_a_cuda_embedding_are_compared_as_on_the_cpu():
    weights = _llama3_like(47)
    stored = assets_mod.embedding_row_projections(weights)
    assert torch.equal(assets_mod.embedding_row_projections(weights.cuda()), stored)
    tuned = weights.clone()
    tuned[[3, 300]] += 0.01
    assert assets_mod.changed_rows(stored, tuned.cuda().bfloat16()).tolist() == [3, 300]


def test_malformed_row_projections_are_named(tmp_path, monkeypatch, embedding):
    monkeypatch.setenv("FLASHHEAD_CACHE_DIR", str(tmp_path / "cache"))
    _, assets = flash_head_for(embedding, SIZE, iters=2, progress=False)
    expected = f"must be a float32 or float64 torch.Tensor of shape [{VOCAB}, 4]"
    for wrong in (assets.row_projections[:-1], assets.row_projections[:, :3], assets.row_projections.long(),
                  assets.row_projections.bfloat16(), [[0.0] * 4] * VOCAB):
        error = TypeError if isinstance(wrong, list) else ValueError
        with pytest.raises(error, match=re.escape(f"embedding_row_projections in the assets to save (assets.raw_centroids "
                                                  f"transposed) {expected}")):
            save_assets(tmp_path / "saved", dataclasses.replace(assets, row_projections=wrong))
        for weights in (embedding, -embedding):  # the same weights, or others whose fingerprint warns first
            with pytest.raises(error, match=re.escape(f"assets.row_projections {expected}")):
                dataclasses.replace(assets, row_projections=wrong).head(weights)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dataclasses.replace(assets, row_projections=assets.row_projections.double()).head(embedding)
    # float64 ones are kept, saved and compared as float32: one past float32's range is named.
    huge = assets.row_projections.double()
    huge[3, 1] = 1e300
    with pytest.raises(ValueError, match=re.escape("assets.row_projections hold NaN or infinite values (as float32")):
        dataclasses.replace(assets, row_projections=huge).head(embedding)
    save_assets(tmp_path / "doubled", dataclasses.replace(assets, row_projections=assets.row_projections.double()))
    assert load_file(str(tmp_path / "doubled" / "flash_head_assets" / TENSORS_NAME))[
        "embedding_row_projections"].dtype == torch.float32
    save_assets(tmp_path / "saved", assets)
    path = tmp_path / "saved" / "flash_head_assets" / TENSORS_NAME
    stored = load_file(str(path))
    assert torch.equal(stored["embedding_row_projections"], assets.row_projections)
    assert set(stored) == {"centroids", "cluster_assignments", "embedding_row_projections"}  # older loaders read two
    config = json.loads((tmp_path / "saved" / CONFIG_NAME).read_text())
    del config["flash_head_tensors_sha256"]
    (tmp_path / "saved" / CONFIG_NAME).write_text(json.dumps(config))
    for wrong, expected in ((stored["embedding_row_projections"][:, :2], expected),
                            (torch.full((VOCAB, 4), float("nan")), "hold NaN or infinite values")):
        save_file({**stored, "embedding_row_projections": wrong.contiguous()}, str(path))
        with pytest.raises(ValueError, match=re.escape(f"embedding_row_projections in {path} {expected}")):
            load_assets(tmp_path / "saved")


@pytest.mark.parametrize("cache_dir", ["", "."])
def test_tensors_beside_the_config_load(tmp_path, embedding, clustering, cache_dir):
    save_assets(tmp_path, clustering, cache_dir=cache_dir)
    assert (tmp_path / TENSORS_NAME).is_file()
    assert torch.equal(load_assets(tmp_path, embedding).cluster_tokens, clustering.cluster_tokens)


def test_a_fingerprinted_clustering_loads_for_a_meta_embedding(tmp_path, monkeypatch, embedding):
    # Shapes only, as before fingerprints: a meta tensor has no values to compare.
    monkeypatch.setenv("FLASHHEAD_CACHE_DIR", str(tmp_path / "cache"))
    save_assets(tmp_path / "saved", flash_head_for(embedding, SIZE, iters=2, progress=False)[1])
    assert load_assets(tmp_path / "saved", embedding.to("meta")).num_clusters == VOCAB // SIZE


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_digests_hash_slices_as_the_whole_tensor(monkeypatch, dtype):
    # Cache keys name entries already on disk: hashing a slice at a time must give the digest of the
    # whole float32 copy, at any slice size, for a tensor that is not contiguous too.
    values = torch.randn(37, 11, generator=torch.Generator().manual_seed(31)) * 50
    tensor = values.to(dtype).t()  # [11, 37], not contiguous
    whole = hashlib.sha256(repr(tuple(tensor.shape)).encode())
    whole.update(tensor.to(torch.float32).contiguous().numpy().tobytes())
    for size in (1, 7, 407, 1 << 22):
        monkeypatch.setattr(assets_mod, "DIGEST_SLICE", size)
        assert assets_mod.embedding_digest(tensor) == whole.hexdigest(), size


def test_a_cache_entry_that_cannot_be_looked_at_is_a_miss(tmp_path, monkeypatch, embedding):
    # Another user's entry in a shared cache, unreadable to this one: pathlib raises PermissionError
    # where a path cannot be looked at (not for a missing one). The clustering is built instead.
    monkeypatch.setenv("FLASHHEAD_CACHE_DIR", str(tmp_path / "cache"))
    _, built = flash_head_for(embedding, SIZE, iters=2, progress=False)
    clusters = tmp_path / "cache" / "clusters"

    def denied(real):
        def look(self, *args, **kwargs):
            if self.is_relative_to(clusters):
                raise PermissionError(13, "Permission denied", str(self))
            return real(self, *args, **kwargs)
        return look

    for name in ("is_file", "is_dir", "glob"):
        monkeypatch.setattr(Path, name, denied(getattr(Path, name)))
    assert not assets_mod.cached_entry(clusters / "x" / CONFIG_NAME) and not assets_mod.cached_entry(clusters, is_dir=True)
    assets_mod.sweep_stale_partials(clusters)  # nothing of ours to sweep there
    with warnings.catch_warnings(record=True):  # the rebuilt entry may fail to be cached, and says so
        warnings.simplefilter("always")
        _, again = flash_head_for(embedding, SIZE, iters=2, progress=False)
    assert torch.equal(again.cluster_tokens, built.cluster_tokens)
