"""Former home of the capture adapters, kept so older ``import traceml.integrations.rfdetr`` lines
keep working until the next major version; the code lives in :mod:`traceml.capture`."""
