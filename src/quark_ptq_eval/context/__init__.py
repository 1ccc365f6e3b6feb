"""The recipe's inputs: session and environment context, read when given and produced when not."""
