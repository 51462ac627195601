"""NeMo AutoModel glue: the numerical loss as a YAML `loss_fn` (loss.NumericalLoss, torch only)
and the recipe that counts each step's digit targets and logs the digit entries
(recipe.NumericalLossRecipe, which imports nemo_automodel). docs/automodel.md."""
