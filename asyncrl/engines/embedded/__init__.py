"""An engine embedded in another service, published into from a learner in another process.

``server``: ``EngineControl``, the control routes the service mounts in its own aiohttp app; ``client``:
``RemoteControlEngine``, the ``WeightTarget`` + ``Lifecycle`` the learner's ``WeightSync`` drives.
"""

from asyncrl.engines.embedded.client import ControlError, RemoteControlEngine
from asyncrl.engines.embedded.server import CONTROL_PREFIX, EngineControl, engine_control_routes

__all__ = ["CONTROL_PREFIX", "ControlError", "EngineControl", "RemoteControlEngine", "engine_control_routes"]
