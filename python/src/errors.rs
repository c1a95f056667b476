//! gpucast's errors as Python exceptions: the classes of `gpucast.errors` (a `gpucast.Error`
//! base, with one subclass per kind), each with gpucast's message and its causes.

use gpucast::Error;
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::types::PyType;

/// The `gpucast.errors` class for `e`.
fn class_of(e: &Error) -> &'static str {
    match e {
        Error::LibraryMissing { .. } => "LibraryError",
        Error::NoDevice(_)
        | Error::TooManyDevices { .. }
        | Error::DuplicateDevice { .. }
        | Error::DeviceOutOfRange { .. }
        | Error::RootOutOfRange { .. }
        | Error::OutputCount { .. }
        | Error::WrongDevice { .. }
        | Error::LengthMismatch { .. }
        | Error::ForeignContext { .. }
        | Error::TooLarge { .. }
        | Error::InvalidArgument(_)
        | Error::InvalidList(_)
        | Error::InvalidSetting { .. } => "ArgumentError",
        Error::NcclUnavailable(_) | Error::CopyEngineUnavailable(_) | Error::P2pUnavailable(_) => {
            "UnavailableError"
        }
        Error::Timeout { .. }
        | Error::NcclTimeout { .. }
        | Error::StreamsBusy { .. }
        | Error::LaunchStalled { .. } => "TimeoutError",
        Error::CommunicatorsAborted { .. } => "AbortedError",
        Error::CallMismatch { .. } => "ArgumentError",
        Error::Rendezvous(_) => "RendezvousError",
        _ => "Error",
    }
}

/// `e`'s message followed by its causes.
fn message(e: &Error) -> String {
    let mut msg = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        let s_msg = s.to_string();
        if !msg.contains(&s_msg) {
            msg.push_str(": ");
            msg.push_str(&s_msg);
        }
        source = s.source();
    }
    msg
}

/// The Python exception of `class` (a name in `gpucast.errors`) with `msg`.
fn raise(class: &str, msg: String) -> PyErr {
    Python::attach(|py| {
        let ty = py
            .import("gpucast.errors")
            .and_then(|m| m.getattr(class))
            .and_then(|c| c.cast_into::<PyType>().map_err(PyErr::from));
        match ty {
            Ok(ty) => PyErr::from_type(ty, msg),
            // Only when the package is broken: still an exception, never a panic.
            Err(_) => PyRuntimeError::new_err(msg),
        }
    })
}

/// gpucast's error as its Python exception.
pub(crate) fn to_py(e: Error) -> PyErr {
    raise(class_of(&e), message(&e))
}

/// A `gpucast.ArgumentError` (also a `ValueError`) with `msg`.
pub(crate) fn argument(msg: String) -> PyErr {
    raise("ArgumentError", msg)
}
