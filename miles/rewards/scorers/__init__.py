"""The built-in scorers, one module per reward, each with the `build(settings)` the reward table
(`miles.rewards.REWARD_TYPES`) names as its type's `build` (jpeg.py: `build_compressibility` and
`build_incompressibility`, one per type): digit (with digit_metrics.py, its eval metrics, and ink_bonus.py, the
hackable proxy), jpeg, ocr, pickscore, clip_score, aesthetic, hps, image_reward, vlm_judge, and remote (the
`remote_rm` client, which the dispatch calls itself). What the model scorers' builds share is in `_model.py`.
Every model loads from local files (nothing downloads); the formulas and their sources are in each model's module."""
