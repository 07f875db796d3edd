"""`twinkle.hub`: upstream's hub package; `HubOperation` lives in `twinkle.hub.hub`."""

from twinkle.hub.hub import HubOperation, HubUnavailableError

__all__ = ["HubOperation", "HubUnavailableError"]
