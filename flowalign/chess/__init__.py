"""The chess-puzzle world: board tokens for masked diffusion and the Lichess puzzle data.

``tokenizer`` turns a FEN (plus an optional best move) into a fixed-length token sequence and
back; ``puzzles`` reads the Lichess puzzle CSV. The rewards that judge generated boards
(legality, engine uniqueness, themes) live in ``reward_models/chess/``.
"""
