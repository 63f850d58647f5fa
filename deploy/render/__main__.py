"""``python -m deploy.render``: re-render the deployment files committed in this repository."""

from deploy.render import render_committed

if __name__ == "__main__":
    for written in render_committed():
        print(written)
