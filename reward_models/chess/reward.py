"""The ``chess_puzzle`` reward: is a generated board a legal, unique puzzle of the requested themes?

Per sample (METHODS §4):
- ``legal``: 1 when the board passes ``legality.legality_problems`` (a token sequence that does
  not decode, e.g. with a leftover MASK, is illegal too);
- ``unique``: 1 when ``uniqueness.check_position`` finds one winning solution for the side to
  move; 0 when illegal; NaN when the engine failed twice;
- ``theme_match``: 1 when every requested theme is among the themes ``themes.tag_line`` finds
  on the engine's solution line (vacuously 1 when none are requested); ``theme_score``: the
  fraction of them that is; both 0 when illegal, NaN when the engine failed;
- ``yield``: legal ∧ unique ∧ theme_match (NaN when unique or theme_match is);
- ``partial_yield``: unique × theme_score, yield with partial credit for the themes: a unique
  puzzle with one of two requested themes scores ½ (a denser signal than ``yield`` for RL on
  multi-theme requests; equal to ``yield`` for one theme);
- ``best_move``: 1 when the sample's own best-move tokens name the engine's first move (0 when
  illegal; NaN when the sample carries no move, e.g. FEN strings).

Themes are asked for in ``metadata[i]["themes"]`` (a list of Lichess theme keys, or one
space-separated string); a theme the tagger cannot produce is an error, not a silent 0.

>>> reward = ChessPuzzleReward(nodes=50_000)  # doctest: +SKIP
>>> out = reward(["6k1/5ppp/8/8/8/8/8/R5K1 w - - 0 1"], [""], [{"themes": ["backRankMate"]}])  # doctest: +SKIP
>>> {k: v.tolist() for k, v in out.items()}  # doctest: +SKIP
{'legal': [1.0], 'unique': [1.0], 'theme_match': [1.0], 'theme_score': [1.0], 'yield': [1.0], 'partial_yield': [1.0], 'best_move': [nan]}
"""

from __future__ import annotations

import dataclasses
import weakref
from dataclasses import dataclass, field
from typing import Sequence

import chess
import torch

from pipelines import chess_tokenizer as tokenizer
from reward_models.base import Reward, register_reward
from reward_models.chess.engine import SearchLimit, StockfishPool
from reward_models.chess.legality import legality_problems
from reward_models.chess.themes import EVAL_SCALE, SUPPORTED_THEMES, replay, tag_line
from reward_models.chess.uniqueness import (DEFAULT_RULE, LICHESS, LICHESS_GENERATOR, UniquenessResult,
                                             check_position, generator_units)

NAN = float("nan")


@dataclass
class PuzzleVerdict:
    """Everything the reward found about one sample (``ChessPuzzleReward.judge``)."""

    fen: str | None                  # None when the tokens did not decode
    move: str | None                 # the sample's own best move (tokens), if any
    problems: list[str]              # legality problems; [] when legal
    requested: tuple[str, ...]
    uniqueness: UniquenessResult | None = None
    themes: set[str] = field(default_factory=set)

    @property
    def legal(self) -> bool:
        return not self.problems

    def components(self) -> dict[str, float]:
        if not self.legal:
            return {"legal": 0.0, "unique": 0.0, "theme_match": 0.0, "theme_score": 0.0, "yield": 0.0,
                    "partial_yield": 0.0, "best_move": NAN if self.move is None else 0.0}
        unique = self.uniqueness.unique
        if unique is None:
            return {"legal": 1.0, "unique": NAN, "theme_match": NAN, "theme_score": NAN, "yield": NAN,
                    "partial_yield": NAN, "best_move": NAN}
        hits = sum(t in self.themes for t in self.requested)
        score = hits / len(self.requested) if self.requested else 1.0
        first = self.uniqueness.first
        return {"legal": 1.0, "unique": float(unique), "theme_match": float(score == 1.0), "theme_score": score,
                "yield": float(unique and score == 1.0), "partial_yield": float(unique) * score,
                "best_move": NAN if self.move is None else float(first is not None and first.move == self.move)}


def _requested_themes(meta: dict) -> tuple[str, ...]:
    themes = meta.get("themes", ())
    themes = tuple(themes.split() if isinstance(themes, str) else themes)
    unknown = sorted(set(themes) - set(SUPPORTED_THEMES))
    if unknown:
        raise ValueError(f"chess_puzzle: the theme tagger cannot produce {unknown}; "
                         f"supported: {', '.join(SUPPORTED_THEMES)}")
    return themes


def _decode(sample) -> tuple[str | None, str | None, list[str]]:
    """(FEN, move, problems) of one sample: a FEN string, or a token-id row."""
    if isinstance(sample, str):
        return sample, None, []
    try:
        fen, move = tokenizer.decode(sample)
    except tokenizer.TokenError as exc:
        return None, None, [f"undecodable_tokens: {exc}"]
    return fen, move, []


@register_reward("chess_puzzle")
class ChessPuzzleReward(Reward):
    """Legality, engine uniqueness and theme match of generated chess puzzles.

    samples: a list of B FEN strings (the side to move is the solver), or long [B, SEQ_LEN]
    token ids of ``pipelines.chess_tokenizer`` (or a list of B id rows; their best-move tokens
    feed ``best_move``);
    prompts: B strings (unused); metadata: B dicts with optional ``"themes"``.
    Returns {component: float [B]} for ``components``.

    Engine settings: ``engines`` Stockfish processes of one thread and ``hash_mb`` each, every
    search limited to ``nodes`` (capped at ``time_limit`` s); ``gap``, ``min_first_cp`` and
    ``max_solver_moves`` as in ``uniqueness.check_position``; ``rule``: "default" (gap 0.5),
    "lichess" (Lichess's generator thresholds, ``uniqueness.LICHESS``, on our cp × ``EVAL_SCALE``)
    or "lichess_generator" (the same thresholds on Stockfish 12–15's cp scale with the win chance
    of 2020–22, ``uniqueness.LICHESS_GENERATOR``, the engine's cp converted by its version,
    ``uniqueness.generator_units``; ``gap`` / ``min_first_cp`` still override), with ``deep_nodes`` to re-search close steps
    deeper. The evaluation themes (advantage, crushing, equality) come from the engine's score of
    the line's last solver move. The engines start at the first
    call and stop with ``close()`` (or when the reward is garbage-collected).
    """

    components = ("legal", "unique", "theme_match", "theme_score", "yield", "partial_yield", "best_move")

    def __init__(self, engines: int = 1, nodes: int = 100_000, time_limit: float = 10.0, hash_mb: int = 16,
                 gap: float | None = None, min_first_cp: int | None = None, max_solver_moves: int = 5,
                 strict_material: bool = False, stockfish: str | None = None, rule: str = "default",
                 deep_nodes: int | None = None):
        # "lichess": Lichess's generator's thresholds on our cp × the tagger's fitted scale; "lichess_generator":
        # on the scale and win chance Stockfish's and lichess-puzzler's sources give (docs/chess.md compares them)
        rules = {"default": DEFAULT_RULE, "lichess": dataclasses.replace(LICHESS, cp_scale=EVAL_SCALE),
                 "lichess_generator": LICHESS_GENERATOR}
        if rule not in rules:
            raise ValueError(f"chess_puzzle: rule must be one of {sorted(rules)}, got {rule!r}")
        self.pool_kwargs = dict(size=engines, limit=SearchLimit(nodes=nodes, time=time_limit), path=stockfish,
                                hash_mb=hash_mb)
        self.check_kwargs = dict(gap=gap, min_first_cp=min_first_cp, max_solver_moves=max_solver_moves,
                                 rule=dataclasses.replace(rules[rule], deep_nodes=deep_nodes))
        self.strict_material, self.rule_name = strict_material, rule
        self._pool: StockfishPool | None = None

    @property
    def pool(self) -> StockfishPool:
        if self._pool is None:
            pool = StockfishPool(**self.pool_kwargs)
            if self.rule_name == "lichess_generator":  # its thresholds are in Stockfish 12–15's cp: convert this engine's
                try:
                    scale = generator_units(pool.name)
                except ValueError:
                    pool.close()
                    raise
                self.check_kwargs["rule"] = dataclasses.replace(self.check_kwargs["rule"], cp_scale=scale)
            self._pool = pool
            weakref.finalize(self, self._pool.close)
        return self._pool

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    def judge(self, samples: Sequence[str] | torch.Tensor, metadata: Sequence[dict]) -> list[PuzzleVerdict]:
        """One ``PuzzleVerdict`` per sample (engine searches run once per distinct legal FEN)."""
        if len(samples) != len(metadata):
            raise ValueError(f"chess_puzzle: {len(samples)} samples but {len(metadata)} metadata dicts")
        verdicts = []
        for sample, meta in zip(samples, metadata):
            fen, move, problems = _decode(sample)
            if fen is not None:
                problems = legality_problems(fen, self.strict_material)
            verdicts.append(PuzzleVerdict(fen, move, problems, _requested_themes(meta)))
        legal_fens = list(dict.fromkeys(v.fen for v in verdicts if v.legal))
        results = dict(zip(legal_fens, self.pool.map(
            lambda engine, fen: check_position(chess.Board(fen), engine, **self.check_kwargs), legal_fens))
            if legal_fens else ())  # a batch of illegal boards starts no engine
        for v in verdicts:
            if v.legal:
                v.uniqueness = results[v.fen]
                v.themes = _line_themes(v.fen, v.uniqueness)
        return verdicts

    def __call__(self, samples, prompts: list[str], metadata: list[dict]) -> dict[str, torch.Tensor]:
        rows = [v.components() for v in self.judge(samples, metadata)]
        return {name: torch.tensor([r[name] for r in rows], dtype=torch.float32) for name in self.components}


def _line_themes(fen: str, result: UniquenessResult) -> set[str]:
    """Themes of the engine's line; a position rejected at its first move is tagged on that move alone."""
    line = result.line or ([result.first.move] if result.first is not None else [])
    last = result.last if result.line else None
    eval_cp = None if last is None else (last.cp if last.mate is None else 100_000 if last.mate > 0 else -100_000)
    return tag_line(replay(chess.Board(fen), line), eval_cp) if line else set()
