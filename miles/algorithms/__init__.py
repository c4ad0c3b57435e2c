"""The training formulas: pure tensor math (no Ray, no diffusers), called by the methods of `miles.training.methods`.

Every loss takes predictions the trainer already computed and returns `(loss: Tensor, metrics: dict[str, float])`:

    policy_loss        Flow-GRPO clipped ratio loss + optional reference KL   (miles.algorithms.policy_loss)
    nft_loss           DiffusionNFT implicit positive/negative regression      (miles.algorithms.nft)
    sft_loss           flow matching `mean((v - (noise - x0))**2)`             (miles.algorithms.sft_loss)
    dmd2_generator_loss, dmd2_critic_loss, gan_discriminator_loss  DMD2        (miles.algorithms.dmd2)

Which method uses which formula is the method's business (its module under `miles/training/methods/`); the list
of methods is `miles.methods`.
"""
