"""The data path of training: epoch plans from the cache's metadata (`plan`), the streaming
loader that reads and packs a rank's rows (`loader`), and the copy of each micro-batch to the
device one step ahead (`feed`)."""
