"""A model's training state outside the engine's slots, and the files that hold it.

    slots.py        a slot's complete ``SlotState`` (services/trainer/slot_state.py) out of the
                    engine and back in
    files.py        one ``SlotState`` as one file: the codec and its durable write
    paging.py       ``PageStore``: the states of models that hold no slot
    snapshots.py    the trainer's internal snapshots (recovery replays only the units after one)
    checkpoints.py  save_state / save_weights_for_sampler: the copy on the unit path, the files
                    written behind it, and reading a save_state checkpoint back
"""
