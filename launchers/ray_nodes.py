"""Run one command per node of a running Ray cluster: torchrun's per-node share, placed by Ray.

    python launchers/ray_nodes.py --nodes 2 --log-dir LOGS -- torchrun --node-rank {node_rank} \
        --master-addr {master_addr} ...

Ray places one bundle on each node (STRICT_SPREAD); the bundle of node rank 0 sits on the head, whose
address becomes `{master_addr}`. Each node's output goes to LOG_DIR/ray-node<rank>-<node ip>.log. The first
node to fail stops the others and names itself; the exit status is that node's.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time


def parse_args():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nodes", type=int, required=True, help="nodes to run on (one command each)")
    parser.add_argument("--cpus-per-node", type=float, default=1, help="CPUs reserved per node's bundle")
    parser.add_argument("--gpus-per-node", type=float, default=0, help="GPUs reserved per node's bundle")
    parser.add_argument("--log-dir", required=True)
    parser.add_argument(
        "--placement-timeout", type=float, default=120, help="seconds to wait for the bundles"
    )
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- command with {node_rank} {master_addr}")
    args = parser.parse_args()
    if args.command[:1] == ["--"]:
        args.command = args.command[1:]
    if not args.command:
        parser.error("give the per-node command after --")
    return args


def main() -> int:
    args = parse_args()
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    ray.init(address="auto", log_to_driver=False)
    alive = [n for n in ray.nodes() if n["Alive"]]
    if len(alive) < args.nodes:
        print(f"ray_nodes: error: {len(alive)} Ray nodes alive, {args.nodes} needed", file=sys.stderr)
        return 2
    bundle = {"CPU": args.cpus_per_node, **({"GPU": args.gpus_per_node} if args.gpus_per_node else {})}
    group = placement_group([dict(bundle) for _ in range(args.nodes)], strategy="STRICT_SPREAD")
    ready, _ = ray.wait([group.ready()], timeout=args.placement_timeout)
    if not ready:
        print(
            f"ray_nodes: error: Ray could not place one {bundle} bundle on each of {args.nodes} nodes within "
            f"{args.placement_timeout:.0f}s; check `ray status`",
            file=sys.stderr,
        )
        return 2

    @ray.remote(num_cpus=0)
    def node_ip() -> str:
        return ray.util.get_node_ip_address()

    def on_bundle(index, **options):
        strategy = PlacementGroupSchedulingStrategy(placement_group=group, placement_group_bundle_index=index)
        return options | {"scheduling_strategy": strategy}

    ips = ray.get([node_ip.options(**on_bundle(i)).remote() for i in range(args.nodes)])
    if ips[0] != ray.util.get_node_ip_address():
        print(f"ray_nodes: note: node rank 0 is {ips[0]}, not the driver's node", file=sys.stderr)

    @ray.remote  # an actor: the driver can call stop() while start() waits
    class NodeProcess:
        """Holds one node's command so the driver can stop it when another node fails."""

        def start(self, command: list[str], env: dict[str, str], log_path: str) -> int:
            with open(log_path, "ab") as log:
                self.proc = subprocess.Popen(
                    command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                )
                return self.proc.wait()

        def stop(self) -> None:
            proc = getattr(self, "proc", None)
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)

    os.makedirs(args.log_dir, exist_ok=True)
    fields = {"master_addr": ips[0]}
    actors, runs = [], {}
    for rank, ip in enumerate(ips):
        command = [part.format(node_rank=rank, **fields) for part in args.command]
        env = dict(os.environ, NODE_RANK=str(rank), MASTER_ADDR=ips[0])
        log_path = os.path.join(args.log_dir, f"ray-node{rank}-{ip}.log")
        actor = NodeProcess.options(
            max_concurrency=2, **on_bundle(rank, num_cpus=args.cpus_per_node)
        ).remote()
        actors.append(actor)
        runs[actor.start.remote(command, env, log_path)] = (rank, ip, log_path)
        print(f"ray_nodes: node rank {rank} on {ip}: log {log_path}", flush=True)

    pending, status = list(runs), 0
    while pending:
        done, pending = ray.wait(pending, num_returns=1)
        rank, ip, log_path = runs[done[0]]
        try:
            rc = ray.get(done[0])
        except ray.exceptions.RayError as err:  # the node or its actor died
            rc, why = 1, f"its Ray process died ({type(err).__name__})"
        else:
            why = f"exit status {rc}"
        if rc != 0 and status == 0:
            status = rc
            print(
                f"ray_nodes: error: node rank {rank} ({ip}) failed with {why}; stopping the other nodes; "
                f"see {log_path}",
                file=sys.stderr,
                flush=True,
            )
            for actor in actors:
                actor.stop.remote()
        elif rc == 0:
            print(f"ray_nodes: node rank {rank} ({ip}) finished", flush=True)
    time.sleep(0.1)
    return status


if __name__ == "__main__":
    sys.exit(main())
