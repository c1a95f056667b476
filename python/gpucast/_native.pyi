"""Type stubs of gpucast's extension module (see the package's docstring)."""

from typing import Any, Callable, Iterable, Optional, Sequence, Union

Bytes = Union[int, str]
MAX_GPUS: int

class Communicator:
    """One rank of a job that runs one process per GPU (torchrun, Slurm, or an explicit
    group of separately launched programs)."""

    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        master_addr: str = "127.0.0.1",
        master_port: int,
        token: Optional[str] = None,
        device: Optional[int] = None,
        local_rank: Optional[int] = None,
        local_world_size: Optional[int] = None,
        shared_devices: bool = False,
        init_timeout: Optional[float] = None,
        path: Optional[str] = None,
        timeout: Optional[float] = None,
        p2p_threshold: Optional[Bytes] = None,
        packet_threshold: Optional[Bytes] = None,
        copy_engine_threshold: Optional[Bytes] = None,
        p2p_chain_threshold: Optional[Bytes] = None,
    ) -> None: ...
    @staticmethod
    def from_exchange(
        all_gather: Callable[[bytes], Sequence[bytes]],
        *,
        rank: int,
        world_size: int,
        device: Optional[int] = None,
        shared_devices: bool = False,
        init_timeout: Optional[float] = None,
        path: Optional[str] = None,
        timeout: Optional[float] = None,
        p2p_threshold: Optional[Bytes] = None,
        packet_threshold: Optional[Bytes] = None,
        copy_engine_threshold: Optional[Bytes] = None,
        p2p_chain_threshold: Optional[Bytes] = None,
    ) -> "Communicator": ...

    @staticmethod
    def from_env(
        *,
        device: Optional[int] = None,
        shared_devices: bool = False,
        init_timeout: Optional[float] = None,
        path: Optional[str] = None,
        timeout: Optional[float] = None,
        p2p_threshold: Optional[Bytes] = None,
        packet_threshold: Optional[Bytes] = None,
        copy_engine_threshold: Optional[Bytes] = None,
        p2p_chain_threshold: Optional[Bytes] = None,
    ) -> "Communicator": ...
    @property
    def rank(self) -> int: ...
    @property
    def world_size(self) -> int: ...
    @property
    def local_rank(self) -> int: ...
    @property
    def device(self) -> int: ...
    @property
    def single_host(self) -> bool: ...
    @property
    def stream_handle(self) -> int: ...
    def route(self, nbytes: int, *, path: Optional[str] = None) -> str: ...
    def broadcast(self, tensor: Any, src: int = 0, *, path: Optional[str] = None,
                  stream: Optional[int] = None) -> None: ...
    def broadcast_many(self, tensors: Iterable[Any], src: int = 0, *,
                       path: Optional[str] = None, stream: Optional[int] = None) -> None: ...
    def synchronize(self) -> None: ...

class Clique:
    """Several GPUs (ranks) driven by this one process."""

    def __init__(
        self,
        devices: Optional[Sequence[int]] = None,
        *,
        shared_devices: bool = False,
        path: Optional[str] = None,
        timeout: Optional[float] = None,
        p2p_threshold: Optional[Bytes] = None,
        packet_threshold: Optional[Bytes] = None,
        copy_engine_threshold: Optional[Bytes] = None,
        p2p_chain_threshold: Optional[Bytes] = None,
    ) -> None: ...
    @property
    def devices(self) -> list[int]: ...
    def __len__(self) -> int: ...
    def route(self, nbytes: int, *, path: Optional[str] = None) -> str: ...
    def broadcast(self, src: int, tensor: Any, outputs: list[Any], *,
                  path: Optional[str] = None, stream: Optional[int] = None) -> None: ...
    def broadcast_in_place(self, src: int, tensors: list[Any], *, path: Optional[str] = None,
                           stream: Optional[int] = None) -> None: ...
    def broadcast_many(self, src: int, inputs: Iterable[Any], outputs: list[list[Any]], *,
                       path: Optional[str] = None, stream: Optional[int] = None) -> None: ...
    def broadcast_many_in_place(self, src: int, tensors: list[list[Any]], *,
                                path: Optional[str] = None,
                                stream: Optional[int] = None) -> None: ...
    def synchronize(self) -> None: ...
    def stream_handle(self, rank: int) -> int: ...

def nccl_version() -> tuple[int, int, int]: ...
def random_token() -> str: ...
def describe_tensor(tensor: Any, device: Optional[int] = None,
                    stream: Optional[int] = None) -> dict[str, Any]: ...
