"""Hostile data files for the task loaders (tasks/jsonl.py, tasks/hf_datasets.py, tasks/guard.py).

The outside tester found: a 200 KB JSON file nested 100,000 deep segfaulted the HF-datasets loader
(pyarrow's JSON reader); an image decompression bomb in a parquet raised out of the loader; a
binary column silently became the text "b'...'"; a lone surrogate in an extra column broke hint and
teacher prompts mid-run. Each case asserts one ValueError naming the file and the line, column or
row (or the bounded outcome: a column left out, a line skipped and counted), and a time cap: 5 s
for a case (the first `datasets` import and a small dataset build fit well inside it).
"""

from __future__ import annotations

import json
import struct
import time
import zlib
from pathlib import Path

import pytest

from adarl.config import TaskConfig
from adarl.tasks import guard
from adarl.tasks.hf_datasets import load_hf_datasets
from adarl.tasks.jsonl import load_jsonl, read_jsonl

datasets = pytest.importorskip("datasets")
pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

CAP_S = 5.0
GOOD = [{"id": f"q{k}", "prompt": f"What is {k}+{k}?", "answer": str(2 * k)} for k in range(1, 5)]


@pytest.fixture(autouse=True)
def _offline_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))  # never the user's cache
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture(autouse=True)
def _time_cap():
    start = time.monotonic()
    yield
    assert time.monotonic() - start < CAP_S


def jsonl(tmp_path: Path, lines: list[str], name: str = "data.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8", errors="surrogatepass")
    return path


def good_lines() -> list[str]:
    return [json.dumps(r) for r in GOOD]


def cfg(path: Path, **kw) -> TaskConfig:
    source = "hf_datasets" if kw.pop("hf", False) else "jsonl"
    return TaskConfig(source=source, path=str(path), eval_size=1, **kw)


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


# --- depth -----------------------------------------------------------------------------------------

def test_jsonl_line_nested_100000_deep_is_refused_naming_line_and_column(tmp_path):
    path = jsonl(tmp_path, [*good_lines(), '{"prompt": "q", "x": ' + nested(100_000) + "}"])
    # the object opens level 1 at column 1; the lists open levels 2.. from column 22, so 65 at 22 + 63
    with pytest.raises(ValueError, match=r"data.jsonl, line 5: JSON nested more than 64 levels deep \(column 85\)"):
        read_jsonl(path, cfg(path))


@pytest.mark.parametrize("suffix", [".json", ".jsonl"])
def test_hf_json_nested_100000_deep_is_refused_before_pyarrow_reads_it(tmp_path, suffix):
    # 200 KB, as the tester's file: pyarrow's reader segfaulted the process on it
    # level 1 at column 1, the lists from column 12: level 65 at 12 + 63 = 75
    path = tmp_path / f"deep{suffix}"
    path.write_text('{"prompt": ' + nested(100_000) + "}\n")
    assert path.stat().st_size > 200_000
    with pytest.raises(ValueError, match=rf"deep\{suffix}, line 1, column 75: JSON nested more than 64 levels"):
        load_hf_datasets(cfg(path, hf=True), 0)


def test_hf_deep_json_inside_a_folder_names_the_file(tmp_path):
    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in GOOD))
    (folder / "test.jsonl").write_text(json.dumps(GOOD[0]) + "\n" + '{"prompt": "q", "x": ' + nested(70) + "}\n")
    with pytest.raises(ValueError, match=r"test\.jsonl, line 2, column \d+: JSON nested more than 64"):
        load_hf_datasets(cfg(folder, hf=True, split="train"), 0)


def test_depth_64_is_accepted_and_65_refused(tmp_path):
    # the object is level 1, so 63 lists reach 64 levels
    ok = jsonl(tmp_path, [*good_lines(), '{"prompt": "q", "x": ' + nested(63) + "}"], "ok.jsonl")
    assert len(read_jsonl(ok, cfg(ok))) == 5
    bad = jsonl(tmp_path, [*good_lines(), '{"prompt": "q", "x": ' + nested(64) + "}"], "bad.jsonl")
    with pytest.raises(ValueError, match=r"bad.jsonl, line 5: JSON nested more than 64"):
        read_jsonl(bad, cfg(bad))


@pytest.mark.parametrize("text", ["[" * 5000, "]]]]{{{{" * 500, 'a\\"' + "[" * 100, "\\\\" + "{" * 100])
def test_brackets_inside_strings_do_not_count(tmp_path, text):
    # a question may be full of brackets; escaped quotes and backslashes do not end the string early
    line = '{"prompt": "' + text + '", "answer": "1"}'
    json.loads(line)  # the line is valid JSON
    path = jsonl(tmp_path, [*good_lines(), line])
    assert read_jsonl(path, cfg(path))[-1].columns["question"] == json.loads(line)["prompt"]
    assert guard.json_depth(path) is None


def test_depth_scan_spans_chunk_boundaries(tmp_path, monkeypatch):
    # an escape whose backslash ends one chunk and whose quote starts the next must still be skipped
    monkeypatch.setattr(guard, "_CHUNK", 10)  # the backslash is the 10th byte: the last of the first chunk
    path = tmp_path / "x.json"
    path.write_text('{"a": "xx\\"[[[[[[", "b": ' + nested(3) + "}")
    assert path.read_bytes()[9:11] == b'\\"'
    assert guard.json_depth(path, limit=4) is None
    assert guard.json_depth(path, limit=3) == (1, 28, 4)  # "{" is level 1; the lists open at columns 26-28


def test_skip_bad_lines_skips_a_deep_line_and_counts_it(tmp_path):
    lines = good_lines() * 3
    path = jsonl(tmp_path, [*lines[:6], '{"prompt": ' + nested(10_000) + "}", *lines[6:]])
    source = load_jsonl(cfg(path, skip_bad_lines=True, max_bad_fraction=0.2), 0)
    assert source.skipped == 1 and "line 7: JSON nested more than 64" in source.first_bad


# --- size ------------------------------------------------------------------------------------------

def test_jsonl_file_over_max_file_mb_is_refused_before_reading(tmp_path):
    path = jsonl(tmp_path, [json.dumps({"prompt": "x" * 2000})] * 600)  # ~1.2 MB
    with pytest.raises(ValueError, match=r"data.jsonl: the file is 1\.\d MiB, more than task.max_file_mb \(1 MiB\)"):
        read_jsonl(path, cfg(path, max_file_mb=1))


def test_jsonl_line_over_max_row_mb_is_refused_naming_it(tmp_path):
    path = jsonl(tmp_path, [*good_lines(), json.dumps({"prompt": "x" * 200_000})])
    with pytest.raises(ValueError, match=r"data.jsonl, line 5: the line is over 0\.1 MiB, more than task.max_row_mb"):
        read_jsonl(path, cfg(path, max_row_mb=0.1))


def test_an_oversized_line_is_skipped_whole_and_the_next_line_read(tmp_path):
    # the line is read in pieces no larger than the limit; its tail must not be parsed as a line
    lines = good_lines() * 3
    path = jsonl(tmp_path, [*lines[:5], json.dumps({"prompt": "y" * 3_000_000}), *lines[5:]])
    source = load_jsonl(cfg(path, max_row_mb=0.5, skip_bad_lines=True, max_bad_fraction=0.2), 0)
    assert source.skipped == 1 and "line 6: the line is over" in source.first_bad
    assert len(source.train) + len(source.eval) == 4  # the 12 good lines hold 4 distinct problems


def test_a_file_with_no_newline_at_all_is_bounded_by_max_row_mb(tmp_path):
    path = tmp_path / "one.jsonl"
    path.write_text(json.dumps({"prompt": "z" * 3_000_000}))  # one 3 MB line, no newline
    with pytest.raises(ValueError, match=r"one.jsonl, line 1: the line is over 1\.0 MiB"):
        read_jsonl(path, cfg(path, max_row_mb=1))


def test_hf_file_over_max_file_mb_is_refused(tmp_path):
    path = tmp_path / "big.csv"
    path.write_text("prompt\n" + ("x" * 1000 + "\n") * 1200)
    with pytest.raises(ValueError, match=r"big.csv: the file is 1\.\d MiB, more than task.max_file_mb \(1 MiB\)"):
        load_hf_datasets(cfg(path, hf=True, max_file_mb=1), 0)


def test_hf_folder_whose_files_together_exceed_max_file_mb_is_refused(tmp_path):
    folder = tmp_path / "data"
    folder.mkdir()
    for name in ("train", "test", "validation"):
        (folder / f"{name}.csv").write_text("prompt\n" + ("x" * 1000 + "\n") * 400)  # 0.4 MB each
    with pytest.raises(ValueError, match=r"data: its data files hold 1\.\d MiB, more than task.max_file_mb"):
        load_hf_datasets(cfg(folder, hf=True, split="train", max_file_mb=1), 0)


def test_hf_row_over_max_row_mb_is_refused_naming_the_row(tmp_path):
    path = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"prompt": ["a", "b", "c" * 300_000, "d"]}), path)
    with pytest.raises(ValueError, match=r"rows.parquet, row 3: the row is over 0\.2 MiB of text"):
        load_hf_datasets(cfg(path, hf=True, max_row_mb=0.2), 0)


# --- decompression ---------------------------------------------------------------------------------

def test_parquet_that_decompresses_past_max_file_mb_is_refused_from_its_footer(tmp_path):
    path = tmp_path / "bomb.parquet"
    pq.write_table(pa.table({"prompt": ["a" * 1000 + str(i) for i in range(3000)]}), path, compression="zstd",
                   use_dictionary=False)  # 3 MB of text, a few KB on disk
    assert path.stat().st_size < 200_000
    with pytest.raises(ValueError, match=r"bomb.parquet: the parquet data decompresses to [23]\.\d MiB, more than "
                                         r"task.max_file_mb \(1 MiB\) allows \(a decompression bomb\?\)"):
        load_hf_datasets(cfg(path, hf=True, max_file_mb=1), 0)


def test_parquet_decompression_ratio_is_bounded(tmp_path, monkeypatch):
    monkeypatch.setattr(guard, "RATIO_FLOOR_BYTES", 0)  # the real floor is 64 MiB: too much to write in a test
    path = tmp_path / "ratio.parquet"
    pq.write_table(pa.table({"prompt": ["b" * 100_000] * 20}), path, compression="zstd", use_dictionary=False)
    with pytest.raises(ValueError, match=r"ratio.parquet: the parquet data decompresses \d+ times .* more than 1000"):
        load_hf_datasets(cfg(path, hf=True), 0)


def test_parquet_with_a_forged_footer_is_one_clear_error(tmp_path):
    path = tmp_path / "torn.parquet"
    pq.write_table(pa.table({"prompt": ["a", "b", "c"]}), path)
    data = path.read_bytes()
    path.write_bytes(data[:-8] + struct.pack("<i", 10**9) + b"PAR1")  # a footer length past the file
    with pytest.raises(ValueError, match=r"torn.parquet: not readable as a dataset \(its parquet footer\): "):
        load_hf_datasets(cfg(path, hf=True), 0)


# --- binary where text is required ----------------------------------------------------------------

def binary_parquet(tmp_path: Path, prompt_binary: bool) -> Path:
    path = tmp_path / "bin.parquet"
    prompts = [f"What is {k}?".encode() for k in range(4)]
    table = pa.table({"prompt": pa.array(prompts, pa.binary()) if prompt_binary else [p.decode() for p in prompts],
                      "blob": pa.array([b"\x00\x01raw" + bytes([k]) for k in range(4)], pa.binary())})
    pq.write_table(table, path)
    return path


def test_a_binary_prompt_column_is_refused_naming_it(tmp_path):
    path = binary_parquet(tmp_path, prompt_binary=True)
    with pytest.raises(ValueError, match=r"task.fields.prompt: .*bin.parquet.*: column 'prompt' holds binary data, "
                                         r"not text"):
        load_hf_datasets(cfg(path, hf=True), 0)


def test_a_binary_answer_column_is_refused_naming_it(tmp_path):
    path = binary_parquet(tmp_path, prompt_binary=False)
    with pytest.raises(ValueError, match=r"task.fields.answer: .*column 'blob' holds binary data"):
        load_hf_datasets(cfg(path, hf=True, fields={"answer": "blob"}), 0)


def test_a_binary_extra_column_never_becomes_b_quoted_text(tmp_path):
    source = load_hf_datasets(cfg(binary_parquet(tmp_path, prompt_binary=False), hf=True), 0)
    problems = source.train + source.eval
    assert len(problems) == 4
    assert all("blob" not in p.columns for p in problems)
    assert "b'" not in json.dumps([p.columns for p in problems])


def png_bomb(width: int = 60_000, height: int = 60_000) -> bytes:
    """A 100-byte PNG whose header claims 3.6 billion pixels: PIL refuses it as a decompression bomb."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\x00" * 64)) + \
        chunk(b"IEND", b"")


def image_dataset(tmp_path: Path) -> Path:
    ds = datasets.Dataset.from_dict({"prompt": ["What is 1?", "What is 2?", "What is 3?", "What is 4?"],
                                     "picture": [{"bytes": png_bomb(), "path": None}] * 4},
                                    features=datasets.Features({"prompt": datasets.Value("string"),
                                                                "picture": datasets.Image()}))
    path = tmp_path / "images.parquet"
    ds.to_parquet(str(path))
    return path


def test_an_image_bomb_column_is_never_decoded(tmp_path):
    PIL = pytest.importorskip("PIL.Image")
    import io

    with pytest.raises(PIL.DecompressionBombError):  # what decoding it would do
        PIL.open(io.BytesIO(png_bomb())).load()
    source = load_hf_datasets(cfg(image_dataset(tmp_path), hf=True), 0)
    assert all(set(p.columns) == {"question"} for p in source.train + source.eval)


def test_an_image_column_as_the_prompt_is_refused(tmp_path):
    pytest.importorskip("PIL.Image")
    with pytest.raises(ValueError, match=r"task.fields.prompt: .*images.parquet.*column 'picture' holds image "
                                         r"data, not text"):
        load_hf_datasets(cfg(image_dataset(tmp_path), hf=True, fields={"prompt": "picture"}), 0)


def test_a_string_column_of_invalid_utf8_is_one_error_naming_the_row(tmp_path):
    path = tmp_path / "utf8.parquet"
    raw = pa.array([b"What is 1?", b"What is 2?", b"bad \xff\xfe", b"What is 4?"], pa.binary())
    table = pa.Table.from_arrays([raw.view(pa.string())], names=["prompt"])
    pq.write_table(table, path)
    with pytest.raises(ValueError, match=r"utf8.parquet.*(row \d|not readable as a dataset)"):
        load_hf_datasets(cfg(path, hf=True), 0)


# --- invalid Unicode in any column -------------------------------------------------------------------

@pytest.mark.parametrize(("row", "field"), [
    ({"prompt": "q", "hint": "see \\ud800 here"}, "hint"),  # an extra column: hints and teachers read it
    ({"prompt": "q", "notes": ["ok", {"deep": "\\udfff"}]}, "notes"),  # nested inside a column
    ({"prompt": "q", "k\\ud83d": "v"}, "k\\\\ud83d"),  # the column's name
    ({"prompt": [{"role": "user", "content": "hi \\ud800"}]}, "prompt"),  # a chat message
    ({"prompt": "q", "answer": "\\udc00"}, "answer"),
])
def test_a_lone_surrogate_in_any_column_is_refused_naming_it(tmp_path, row, field):
    line = json.dumps(row).replace("\\\\u", "\\u")  # json.dumps escaped our backslash: put the escape back
    path = jsonl(tmp_path, [*good_lines(), line])
    with pytest.raises(ValueError, match=rf"data.jsonl, line 5: field '{field}' holds a character that is not "
                                         r"valid Unicode text \(.*a lone surrogate\)"):
        read_jsonl(path, cfg(path))


def test_a_lone_surrogate_in_an_hf_json_extra_column_is_refused(tmp_path):
    path = jsonl(tmp_path, [*good_lines(), '{"prompt": "q", "hint": "x \\ud800 y"}'], "s.jsonl")
    # pyarrow's reader refuses it itself (its row count starts at 0); the message must carry its reason
    with pytest.raises(ValueError, match=r"s.jsonl: not readable as a dataset: .*surrogate pair in string is invalid"):
        load_hf_datasets(cfg(path, hf=True), 0)


def test_a_skipped_surrogate_line_leaves_every_column_encodable(tmp_path):
    lines = good_lines() * 3
    path = jsonl(tmp_path, [*lines, '{"prompt": "q2", "hint": "\\ud800"}'])
    source = load_jsonl(cfg(path, skip_bad_lines=True, max_bad_fraction=0.2), 0)
    assert source.skipped == 1
    for p in source.train + source.eval:
        json.dumps(p.columns, ensure_ascii=False).encode("utf-8")
