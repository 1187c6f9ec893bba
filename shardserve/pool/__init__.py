"""Several models on one set of devices behind one OpenAI endpoint (`shardserve pool CONFIG.yaml`)."""
