"""``clef tune``: fit the joint schema head to a user's own labelled cases, the backbone frozen.

The backbone's rows of a case never change while the head learns, so they are computed once and kept on disk
(`features`); tuning then trains a head tier on them (`objective`, `trainer`), measures the change on held-out
cases with paired tests (`statistics`, `report`), and writes the head in the release layout (`command`).
Only the CLI imports this package; it reads the model, engine, evaluation and protocol layers below it.
"""
