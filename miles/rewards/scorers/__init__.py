"""The built-in scorers, one module per reward (the digit reward with its eval metrics and the hackable ink proxy;
jpeg, ocr, pickscore, clip_score, aesthetic, hps, image_reward, vlm_judge; remote, the `remote_rm` client): what the
reward table `miles.rewards.REWARD_TYPES` names as each type's `build`. Every model loads from local files (nothing
downloads); the formulas and their sources are in each model's module."""
