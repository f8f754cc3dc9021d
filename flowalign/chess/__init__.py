"""The chess-puzzle world: board tokens for masked diffusion and the Lichess puzzle data.

The board tokens (a FEN plus an optional best move as a fixed-length token sequence, and back)
are the model family's: ``pipelines/chess_tokenizer.py``. Here: ``puzzles`` reads the Lichess
puzzle CSV, ``requests`` the theme requests, ``diversity`` the evaluation's board diversity. The rewards that judge generated boards
(legality, engine uniqueness, themes) live in ``reward_models/chess/``.
"""
