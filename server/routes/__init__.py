"""One FastAPI router per resource. Routes parse, depend and delegate: the work is in
server.openai (dialects), server.chat (the pipeline) and flashserve.engine."""
