"""Model families: each module alone knows one family's layer layout (its decoder layers, their linear layers and
norms, their names, how they group for the shared base pass) and computes the parts of its layers that are shared
between a function and the base-pass executor. Only the Llama family (`llama`) so far."""
