use std::path::PathBuf;

/// Every way loading a checkpoint can fail. Each variant names the file and the
/// tensor or key involved, and says why.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    // The OS error is in the message, not a `source`: a chain printed whole would say it
    // twice ("No such file or directory (os error 2): No such file or directory …").
    #[error("{path}: cannot read: {error}")]
    Io {
        path: PathBuf,
        error: std::io::Error,
    },
    #[error("{path}: cannot write: {error}")]
    Write {
        path: PathBuf,
        error: std::io::Error,
    },
    #[error("{path}: not a checkpoint we can read: {reason}")]
    Format { path: PathBuf, reason: String },
    #[error("{path}: tensor `{tensor}`: {reason}")]
    Tensor { path: PathBuf, tensor: String, reason: String },
    #[error("{path}: tensor `{tensor}` is missing{hint}")]
    MissingTensor { path: PathBuf, tensor: String, hint: String },
    #[error("{path}: key `{key}`: {reason}")]
    Key { path: PathBuf, key: String, reason: String },
    #[error("{path}: tokenizer: {reason}")]
    Tokenizer { path: PathBuf, reason: String },
    #[error("{path}: chat template: {reason}")]
    ChatTemplate { path: PathBuf, reason: String },
}

impl LoadError {
    pub(crate) fn format(path: impl Into<PathBuf>, reason: impl Into<String>) -> Self {
        LoadError::Format { path: path.into(), reason: reason.into() }
    }
    pub(crate) fn tensor(path: impl Into<PathBuf>, tensor: impl Into<String>, reason: impl Into<String>) -> Self {
        LoadError::Tensor { path: path.into(), tensor: tensor.into(), reason: reason.into() }
    }
    pub(crate) fn key(path: impl Into<PathBuf>, key: impl Into<String>, reason: impl Into<String>) -> Self {
        LoadError::Key { path: path.into(), key: key.into(), reason: reason.into() }
    }
}

pub type Result<T, E = LoadError> = std::result::Result<T, E>;
