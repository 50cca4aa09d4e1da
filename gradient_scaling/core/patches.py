"""Attributes of a framework replaced while one hook is active.

The Chainer adapter routes a few of Chainer's backprop internals to the
active hook: a :class:`Patches` holds those replacements, installs them
for one handler at a time (a graph's gradients can carry one set of
scales) and puts the originals back; ``gradient_scaling/chainer/
_internals.py`` declares what it replaces. (The PyTorch adapter's two,
``torch.autograd.backward`` and ``grad``, are routed once per backward
pass: plain attribute sets in ``gradient_scaling/torch/_internals.py``,
with the same one-handler rule and :data:`ANOTHER_ACTIVE`.) Nothing here
knows a framework.

.. admonition:: Example

    >>> import types
    >>> from gradient_scaling.core.patches import Patches
    >>> owner = types.SimpleNamespace(f=lambda: 'original')
    >>> patches = Patches([(owner, 'f', lambda: 'replaced')])
    >>> handler = object()
    >>> patches.install(handler); owner.f(), patches.original(owner, 'f')()
    ('replaced', 'original')
    >>> patches.uninstall(handler); owner.f(), patches.handler
    ('original', None)

    An attribute the owner lacked is removed again:

    >>> patches = Patches([(owner, 'g', lambda: 'added')])
    >>> patches.install(handler); owner.g()
    'added'
    >>> patches.uninstall(handler); hasattr(owner, 'g')
    False

"""

__all__ = ['Patches', 'ANOTHER_ACTIVE']

#: Why a second handler is refused while one is active.
ANOTHER_ACTIVE = ('another GradientScaling hook is already active; only one '
                  'can scale a backward pass at a time')


_ABSENT = object()


class Patches(object):

    """``(owner, name, replacement)`` triples, installed for one handler.

    Attributes:
        handler: The active handler, or None.

    """

    def __init__(self, replacements):
        self.replacements = list(replacements)
        self.handler = None
        self._originals = {}

    def install(self, handler):
        """Makes ``handler`` the active one (again: nothing to do).

        Raises:
            RuntimeError: If another handler is active.

        """
        if self.handler is not None:
            if self.handler is handler:
                return
            raise RuntimeError(ANOTHER_ACTIVE)
        self.handler = handler
        for owner, name, replacement in self.replacements:
            # (An attribute the owner lacks, e.g. ChainerX's backward where
            # ChainerX is not built, is removed again at uninstall.)
            self._originals[id(owner), name] = getattr(owner, name, _ABSENT)
            setattr(owner, name, replacement)

    def uninstall(self, handler):
        """Puts the originals back, if ``handler`` is the active one."""
        if self.handler is not handler:
            return
        for owner, name, _ in self.replacements:
            original = self._originals[id(owner), name]
            if original is _ABSENT:
                delattr(owner, name)
            else:
                setattr(owner, name, original)
        self._originals.clear()
        self.handler = None

    def active_handler(self):
        """The handler installed now, or None."""
        return self.handler

    def original(self, owner, name):
        """What ``owner.name`` was before :meth:`install`."""
        return self._originals[id(owner), name]
