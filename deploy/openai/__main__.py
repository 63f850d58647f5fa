"""``python -m deploy.openai``: the OpenAI-compatible frontend (see ``deploy.openai.app.main``)."""

from deploy.openai.app import main

raise SystemExit(main())
