"""Rewards for generated chess puzzles: legality, engine uniqueness, theme match (METHODS §4).

One concern per module: ``legality`` (rules a board must satisfy before an engine sees it),
``engine`` (a pool of long-lived Stockfish processes), ``uniqueness`` (one solution along the
principal variation, on Lichess's win-chance scale), ``themes`` (a rule-based theme tagger of a
solution line) and ``reward`` (the registered ``chess_puzzle`` reward that combines them).
"""
