"""The default model: a small Bamba trained on the Python standard library by `hybridserve train-demo`.

`corpus` (data and split), `train_forward` (a differentiable forward over the serving model's parameters),
`train` (the command), `default` (the committed weights written out as a checkpoint with its model card)."""
