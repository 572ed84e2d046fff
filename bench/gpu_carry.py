"""Real weights on the GPU machine (issue 49): carry the embedded model there in pieces that fit.

One call to the GPU machine carries at most 64 MiB (the working tree, ~12 MB, included), and SmolLM2's GGUF is
98 MB, so it travels in pieces over consecutive calls to one machine while it is held (a warm machine keeps /tmp).
Each piece travels in a folder of its own with the manifest beside it (the whole file's sha256 and size, each
piece's sha256 and size); each call stores its piece under a store folder, checking it, and the last one
reassembles the file and checks the whole. A missing or corrupt piece is one line naming it (exit 2).

    .venv/bin/python bench/gpu_carry.py split --out .gpu --pieces 2     # here: .gpu/piece0/, .gpu/piece1/
    python3 bench/gpu_carry.py receive .gpu/piece0 --store /tmp/adarl-carry          # there, call 1
    python3 bench/gpu_carry.py receive .gpu/piece1 --store /tmp/adarl-carry          # there, call 2, then:
    python3 bench/gpu_carry.py assemble --store /tmp/adarl-carry --convert /tmp/adarl-carry/hf
    # prints the float32 Hugging Face folder to train from (model.path=...)

`.gpu/` is ignored by git; a call names its piece's folder in the device tool's `carry`. The small wheels adarl
needs there (pydantic and its three helpers, gguf: the machine has the rest) travel in `.whl/` beside it
(`wheels` prints the download command). tests/benchmarks/test_gpu_carry.py runs split, receive, assemble,
the failures and the load on the CPU.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

MANIFEST = "manifest.json"
#: what adarl imports on the GPU machine that its image lacks (the machine's package list: KINDS.md)
WHEELS = ("pydantic==2.14.3", "pydantic-core==2.50.4", "annotated-types==0.8.0", "typing-inspection==0.4.5",
          "gguf==0.19.0", "typing-extensions>=4.16")


class CarryError(Exception):
    """A piece or the whole is missing or corrupt: one line, no traceback."""


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def embedded_gguf() -> Path:
    from adarl.models import resolve_model

    folder, name = resolve_model("smollm2-135m")
    return folder / name


def split(source: Path, out: Path, pieces: int) -> list[Path]:
    """`out`/piece<i>/ for i < `pieces`, each a part of `source` and the manifest."""
    if pieces < 1:
        raise CarryError(f"--pieces must be at least 1, got {pieces}")
    size = source.stat().st_size
    step = -(-size // pieces)
    parts, folders = [], []
    with source.open("rb") as f:
        for i in range(pieces):
            folder = out / f"piece{i}"
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir(parents=True)
            part = folder / f"{source.name}.part{i}"
            part.write_bytes(f.read(step))
            parts.append({"name": part.name, "size": part.stat().st_size, "sha256": sha256(part)})
            folders.append(folder)
    manifest = {"file": source.name, "size": size, "sha256": sha256(source), "pieces": parts}
    for folder in folders:
        (folder / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return folders


def read_manifest(path: Path) -> dict:
    try:
        manifest = json.loads(path.read_text())
        manifest["pieces"], manifest["sha256"], manifest["file"]  # noqa: B018 (the keys must be there)
        return manifest
    except FileNotFoundError:
        raise CarryError(f"no manifest at {path}: carry the piece's whole folder (bench/gpu_carry.py split)") from None
    except (ValueError, KeyError, TypeError) as err:
        raise CarryError(f"manifest {path} is not one bench/gpu_carry.py wrote: {err!r}") from None


def check_piece(path: Path, entry: dict) -> None:
    if not path.is_file():
        raise CarryError(f"piece {entry['name']} is missing ({path}): carry its folder in a call first")
    if path.stat().st_size != entry["size"] or sha256(path) != entry["sha256"]:
        raise CarryError(f"piece {entry['name']} is corrupt ({path}: size or sha256 differs from the manifest)")


def receive(folder: Path, store: Path) -> list[str]:
    """Check the pieces in `folder` against its manifest and copy them into `store`; the pieces the store
    now holds."""
    manifest = read_manifest(folder / MANIFEST)
    here = [e for e in manifest["pieces"] if (folder / e["name"]).exists()]
    if not here:
        raise CarryError(f"{folder} holds none of the manifest's pieces")
    store.mkdir(parents=True, exist_ok=True)
    old = store / MANIFEST
    if old.exists() and read_manifest(old)["sha256"] != manifest["sha256"]:
        raise CarryError(f"{store} holds pieces of another file ({read_manifest(old)['file']}): use another --store")
    for entry in here:
        check_piece(folder / entry["name"], entry)
        shutil.copyfile(folder / entry["name"], store / entry["name"])
    (store / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return [e["name"] for e in manifest["pieces"] if (store / e["name"]).exists()]


def assemble(store: Path) -> Path:
    """The whole file, reassembled in `store` from its pieces and checked (sha256); its path."""
    manifest = read_manifest(store / MANIFEST)
    target = store / manifest["file"]
    if target.is_file() and target.stat().st_size == manifest["size"] and sha256(target) == manifest["sha256"]:
        return target
    for entry in manifest["pieces"]:
        check_piece(store / entry["name"], entry)
    partial = target.with_name(target.name + ".tmp")
    with partial.open("wb") as out:
        for entry in manifest["pieces"]:
            with (store / entry["name"]).open("rb") as f:
                shutil.copyfileobj(f, out)
    if sha256(partial) != manifest["sha256"]:
        partial.unlink()
        raise CarryError(f"{manifest['file']}: the reassembled file's sha256 differs from the manifest's")
    partial.replace(target)
    return target


def convert(gguf: Path, dest: Path) -> Path:
    """The float32 Hugging Face folder of `gguf` (adarl's own conversion; kept if already there)."""
    from adarl.models import convert_gguf

    if (dest / "config.json").is_file():
        return dest
    return convert_gguf(gguf, dest)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("split", help="here: the pieces and their manifest")
    p.add_argument("--source", type=Path, default=None, help="the file (default: the embedded SmolLM2 GGUF)")
    p.add_argument("--out", type=Path, default=ROOT / ".gpu")
    p.add_argument("--pieces", type=int, default=2)
    p = sub.add_parser("receive", help="there: check a carried piece and store it")
    p.add_argument("folder", type=Path)
    p.add_argument("--store", type=Path, default=Path("/tmp/adarl-carry"))
    p = sub.add_parser("assemble", help="there: reassemble, check and (with --convert) convert")
    p.add_argument("--store", type=Path, default=Path("/tmp/adarl-carry"))
    p.add_argument("--convert", type=Path, default=None, help="write the float32 HF folder here and print it")
    sub.add_parser("wheels", help="print the command that downloads the wheels into .whl/")
    args = parser.parse_args(argv)
    try:
        if args.command == "split":
            folders = split(args.source or embedded_gguf(), args.out, args.pieces)
            for folder in folders:
                mib = sum(f.stat().st_size for f in folder.iterdir()) / 2**20
                print(f"{folder} ({mib:.1f} MiB)")
        elif args.command == "receive":
            have = receive(args.folder, args.store)
            total = len(read_manifest(args.store / MANIFEST)["pieces"])
            print(f"{args.store}: {len(have)} of {total} pieces ({', '.join(have)})")
        elif args.command == "assemble":
            whole = assemble(args.store)
            print(convert(whole, args.convert) if args.convert else whole)
        else:
            platforms = " ".join(f"--platform {p}" for p in ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64",
                                                              "manylinux2014_x86_64"))
            print(f"python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "
                  f"{platforms} -d .whl " + " ".join(WHEELS))
    except CarryError as err:
        print(f"gpu_carry: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
