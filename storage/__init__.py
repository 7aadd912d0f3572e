from storage.store import Store, StoreError, StoreUnavailable

__all__ = ["Store", "StoreError", "StoreUnavailable"]
