"""Instance attributes the extension replaces, remembered so that :func:`~deepspeed_dgc.zero3.patches.uninstall` can
put them back."""

ORIGINALS = "_dgc_originals"  # instance attribute: the methods an install replaced, for uninstall


def replace(obj, name: str, value) -> None:
    """``obj.name = value``, remembering the instance's own attribute (None: it had none) for :func:`restore`."""
    originals = obj.__dict__.setdefault(ORIGINALS, {})
    originals.setdefault(name, obj.__dict__.get(name))
    setattr(obj, name, value)


def restore(obj, name: str) -> None:
    """Undo :func:`replace` of ``obj.name``: its own attribute as it was, or none (the class's again)."""
    originals = obj.__dict__.get(ORIGINALS, {})
    if name not in originals:
        return
    value = originals.pop(name)
    if value is None:
        obj.__dict__.pop(name, None)
    else:
        setattr(obj, name, value)
