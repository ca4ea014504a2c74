"""Planted bugs that run the real thing: each notebook's claim checks on a
broken layer or model, trained through the notebook's own functions.

A reproduction's claim counts only if a real broken variant makes its check
fail. Each reproduction module (``keras_longattn.reproductions.<slug>``)
declares its variants as ``PLANTED``, a :class:`PlantedSet`:

* ``run(variant)`` trains and measures at a small size through the same
  functions the notebook calls, with the arm under test built by the real
  layer (``variant=None``) or by the named broken variant, and returns the
  notebook's claims (a list of :class:`~keras_longattn.reproductions.claims.Claim`);
* each :class:`PlantedVariant` names the bug and the claims it must fail.

:func:`check` runs the real layers and one variant and says what the check
saw for each targeted claim: a variant is *caught* when every claim it
targets is asserted and passes with the real layers and fails with the
variant. ``tests/notebooks/test_planted_real.py`` requires every variant to
be caught (on JAX, in CI; longify's set in ``test_planted_real_longify.py``);
``tests/notebooks/test_planted_registry.py`` checks, without training, that
every claim a committed full-size run asserts is targeted by a variant (by
:func:`claim_family`: the size in a name aside);
``python -m keras_longattn.reproductions.planted
--write`` runs them all and writes ``docs/results/planted_bugs.json`` (with
its provenance), whose table ``papers/README.md`` shows (claim → variant →
what the check saw).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib
import json
import re
import sys
import time
from pathlib import Path
from typing import Callable, Sequence

from keras_longattn.reproductions.claims import Claim

__all__ = [
    "PLANTED_MODULES",
    "PlantedSet",
    "PlantedVariant",
    "VariantCheck",
    "asserted_claims",
    "check",
    "claim_family",
    "planted_sets",
    "recorded_run",
    "results_table",
    "run_all",
]

#: The reproduction modules whose ``PLANTED`` sets are collected, in the
#: order of the papers' table.
PLANTED_MODULES = (
    "sparse_transformer",
    "routing_transformer",
    "synthesizer",
    "longformer",
    "linformer",
    "adamra",
    "entmax",
    "mpnet",
    "sandwich_transformer",
    "adaptive_span",
    "longify",
)

#: Name of the committed results file (``docs/results/<name>.json``).
RESULTS_NAME = "planted_bugs"


#: A claim name's part that names a size parameter: Linformer's ``k`` of an
#: arm (``parity_k64``, ``beats_control_k64``, ``cost_grows_with_n_k128``).
_SIZED_SUFFIX = re.compile(r"_k[0-9]+$")


def claim_family(name: str) -> str:
    """The name of a claim with its size parameter left out.

    A set's variants name the claims of the small planted run; the
    full-size run names the same checks at its own sizes (Linformer's
    ``beats_control_k8`` at the planted size is ``beats_control_k64`` and
    ``beats_control_k128`` at full size). Both map to one family
    (``beats_control_k<k>``), which is what a variant's target covers at
    every size. Names without a size parameter are their own family."""
    return _SIZED_SUFFIX.sub("_k<k>", name)


@dataclasses.dataclass(frozen=True)
class PlantedVariant:
    """A broken layer or model and the claims whose checks it must fail.

    Attributes:
        name: short identifier, passed to :attr:`PlantedSet.run`.
        bug: what is broken, in one sentence (a real layer or model: e.g.
            "routing layer whose centroids never move").
        claims: the names (:attr:`Claim.name`) of the notebook claims the
            variant must fail.
    """

    name: str
    bug: str
    claims: tuple

    def __post_init__(self):
        if not self.claims:
            raise ValueError(f"planted variant {self.name!r} targets no claim")
        object.__setattr__(self, "claims", tuple(self.claims))


@dataclasses.dataclass(frozen=True)
class PlantedSet:
    """A notebook's planted variants and the function that runs them.

    Attributes:
        slug: the notebook's slug.
        run: ``run(variant_name_or_None) -> list[Claim]``: the notebook's
            claims at a small size, with the real layers (``None``) or with
            the arm under test replaced by the named variant. It may cache
            the arms the variants share (the controls).
        variants: the :class:`PlantedVariant` of the notebook.
    """

    slug: str
    run: Callable[[str | None], Sequence[Claim]]
    variants: tuple

    def __post_init__(self):
        object.__setattr__(self, "variants", tuple(self.variants))
        names = [variant.name for variant in self.variants]
        if len(set(names)) != len(names):
            raise ValueError(f"{self.slug}: planted variant names repeat: {names}")

    def variant(self, name: str) -> PlantedVariant:
        for variant in self.variants:
            if variant.name == name:
                return variant
        raise KeyError(f"{self.slug} has no planted variant {name!r}; "
                       f"it has {[v.name for v in self.variants]}")


@dataclasses.dataclass(frozen=True)
class VariantCheck:
    """What the claim checks saw on the real layers and on one variant."""

    slug: str
    variant: str
    bug: str
    claims: tuple  # per targeted claim: dict(name, statement, real, planted)
    seconds: float

    @property
    def caught(self) -> bool:
        """Every targeted claim asserted, passing on the real layers and
        failing on the variant."""
        return all(
            entry["real"]["asserted"] and entry["real"]["verdict"] == "reproduced"
            and entry["planted"]["failed"]
            for entry in self.claims
        )

    def problems(self) -> list[str]:
        """Why the variant is not caught (empty when it is)."""
        out = []
        for entry in self.claims:
            real, planted = entry["real"], entry["planted"]
            if not real["asserted"]:
                out.append(f"{entry['name']}: not asserted")
            elif real["verdict"] != "reproduced":
                out.append(f"{entry['name']}: the real layers give {real['verdict']!r} "
                           f"({real['ours']})")
            if not planted["failed"]:
                out.append(f"{entry['name']}: the variant passes ({planted['verdict']}, "
                           f"{planted['ours']})")
        return out

    def as_dict(self) -> dict:
        return {"slug": self.slug, "variant": self.variant, "bug": self.bug,
                "caught": self.caught, "seconds": round(self.seconds, 1),
                "claims": list(self.claims)}


def _claim_record(claim: Claim) -> dict:
    return {"verdict": claim.verdict, "ours": claim.ours, "asserted": claim.asserted,
            "failed": claim.failed}


def _by_name(claims: Sequence[Claim], names: Sequence[str], where: str) -> dict:
    found = {claim.name: claim for claim in claims}
    missing = [name for name in names if name not in found]
    if missing:
        raise KeyError(f"{where}: no claim named {missing}; the claims are {sorted(found)}")
    return found


def planted_sets(slugs: Sequence[str] | None = None) -> list[PlantedSet]:
    """The ``PLANTED`` set of each reproduction module (of ``slugs``, or of
    every module in :data:`PLANTED_MODULES` that declares one)."""
    unknown = [slug for slug in slugs or () if slug not in PLANTED_MODULES]
    if unknown:
        raise ValueError(f"`slugs` must name reproductions of {PLANTED_MODULES}. "
                         f"Received: slugs={list(slugs)}")
    out = []
    for slug in slugs or PLANTED_MODULES:
        module = importlib.import_module(f"keras_longattn.reproductions.{slug}")
        planted = getattr(module, "PLANTED", None)
        if planted is None:
            if slugs:
                raise ValueError(f"keras_longattn.reproductions.{slug} declares no PLANTED set")
            continue
        if planted.slug != slug:
            raise ValueError(f"keras_longattn.reproductions.{slug}.PLANTED says slug={planted.slug!r}")
        out.append(planted)
    return out


@functools.lru_cache(maxsize=None)
def _real_claims(planted: PlantedSet) -> tuple:
    return tuple(planted.run(None))


def check(planted: PlantedSet, variant: str) -> VariantCheck:
    """Runs the real layers (once per set) and ``variant``; returns what the
    targeted claims' checks saw."""
    spec = planted.variant(variant)
    start = time.perf_counter()
    real = _by_name(_real_claims(planted), spec.claims, f"{planted.slug} (real layers)")
    broken = _by_name(planted.run(variant), spec.claims, f"{planted.slug} ({variant})")
    seconds = time.perf_counter() - start
    claims = tuple(
        {"name": name, "statement": real[name].statement,
         "real": _claim_record(real[name]), "planted": _claim_record(broken[name])}
        for name in spec.claims
    )
    return VariantCheck(planted.slug, variant, spec.bug, claims, seconds)


def asserted_claims(planted: PlantedSet) -> list[str]:
    """The names of the claims the real layers' run asserts (at the planted
    size), sorted."""
    return sorted(claim.name for claim in _real_claims(planted) if claim.asserted)


def recorded_run(path: str | Path | None = None, root: str | Path | None = None) -> dict | None:
    """The committed planted run (``docs/results/planted_bugs.json``) when it
    describes today's code: ``keras-longattn reproduce --stale`` finds it
    current (``provenance.check_results``, with cached fingerprints only),
    and it holds every variant of :func:`planted_sets` with the same bug and
    targeted claims, and each set's asserted claims. ``None`` otherwise (the
    variants must be trained again).

    Returns ``{"checks": {(slug, variant): VariantCheck}, "asserted": {slug:
    [claim names]}, "commit": ...}``; a check's ``caught`` is derived again
    from the recorded verdicts. ``root``: the checkout the recorded paths
    are relative to (default: the one holding ``path``)."""
    from keras_longattn.reproductions.provenance import check_results

    path = Path(path) if path is not None else _default_output()
    root = Path(root) if root is not None else path.resolve().parents[2]
    try:
        if check_results(path, root, compute=False).stale:
            return None
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    asserted = record.get("asserted")
    if not isinstance(asserted, dict):
        return None
    checks = {}
    for entry in record.get("variants") or ():
        checks[(entry["slug"], entry["variant"])] = VariantCheck(
            entry["slug"], entry["variant"], entry["bug"], tuple(entry["claims"]),
            float(entry.get("seconds") or 0))
    for planted in planted_sets():
        if planted.slug not in asserted:
            return None
        for variant in planted.variants:
            item = checks.get((planted.slug, variant.name))
            if item is None or item.bug != variant.bug or \
                    [c["name"] for c in item.claims] != list(variant.claims):
                return None
    return {"checks": checks, "asserted": asserted, "commit": record["provenance"].get("commit")}


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def results_table(checks: Sequence[VariantCheck]) -> str:
    """Markdown table: notebook, claim, planted variant, what the check saw
    on the real layers and on the variant, caught."""
    lines = ["| notebook | claim | planted variant | real layers | planted variant's check | caught |",
             "|---|---|---|---|---|---|"]
    for item in checks:
        for entry in item.claims:
            real, planted = entry["real"], entry["planted"]
            lines.append(
                f"| {item.slug} | {_cell(entry['name'])} | `{item.variant}`: {_cell(item.bug)} "
                f"| {_cell(real['verdict'])}: {_cell(real['ours'])} "
                f"| {_cell(planted['verdict'])}: {_cell(planted['ours'])} "
                f"| {'yes' if item.caught else 'no'} |")
    return "\n".join(lines)


def run_all(slugs: Sequence[str] | None = None, *, verbose: bool = True) -> list[VariantCheck]:
    """:func:`check` of every variant of every set."""
    checks = []
    for planted in planted_sets(slugs):
        for variant in planted.variants:
            item = check(planted, variant.name)
            if verbose:
                state = "caught" if item.caught else "NOT caught: " + "; ".join(item.problems())
                print(f"[planted] {planted.slug}/{variant.name}: {state} ({item.seconds:.0f} s)",
                      flush=True)
            checks.append(item)
    return checks


def _default_output() -> Path:
    return Path(__file__).resolve().parents[2] / "docs" / "results" / f"{RESULTS_NAME}.json"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m keras_longattn.reproductions.planted",
        description="Runs every planted variant of the reproductions against its claims.")
    parser.add_argument("--slug", action="append", dest="slugs", metavar="SLUG",
                        help=f"only this reproduction (repeatable; one of {', '.join(PLANTED_MODULES)})")
    parser.add_argument("--write", nargs="?", const=str(_default_output()), default=None,
                        metavar="PATH",
                        help=f"write the results JSON (default path: docs/results/{RESULTS_NAME}.json)")
    args = parser.parse_args(argv)
    if args.write:
        # The layers and models the variants and the real arms build: the
        # results file's behaviour record (provenance.write_results).
        from keras_longattn.reproductions import recording

        recording.start()
    import keras

    start = time.perf_counter()
    checks = run_all(args.slugs)
    table = results_table(checks)
    print(table)
    if args.write:
        from keras_longattn.reproductions.provenance import write_results

        write_results(args.write, {
            "notebook": RESULTS_NAME,
            "backend": keras.backend.backend(),
            "variants": [item.as_dict() for item in checks],
            "asserted": {planted.slug: asserted_claims(planted)
                         for planted in planted_sets(args.slugs)},
            "caught": sum(item.caught for item in checks),
            "total": len(checks),
            "table": table,
            "wall_time_s": round(time.perf_counter() - start, 1),
        })
        print(f"[planted] wrote {args.write}")
    return 0 if all(item.caught for item in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
