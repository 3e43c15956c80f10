"""How ranks come up and what each runs: the bring-up (`bringup`: torchrun or spawned ranks in a
`local_group`, watched by the `launcher_watch`), the `bootstrap` record rank 0 sends its workers,
the `worker` loop, and `step`, the one dispatcher of rank 0's messages on every rank."""
