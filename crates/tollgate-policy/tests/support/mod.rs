//! What more than one test file of this crate needs: the policy file's JSON Schema, applied
//! as an editor applies it.

use std::sync::OnceLock;

use serde_json::Value;
use tollgate_policy::JSON_SCHEMA;

/// The schema, compiled once per test binary.
pub(crate) fn validator() -> &'static jsonschema::Validator {
    static VALIDATOR: OnceLock<jsonschema::Validator> = OnceLock::new();
    VALIDATOR.get_or_init(|| {
        let schema: Value = serde_json::from_str(JSON_SCHEMA).expect("the schema is JSON");
        jsonschema::draft7::new(&schema).expect("the schema compiles")
    })
}

/// The schema's complaints about the policy file `text`, one line each (empty when it is
/// valid), the document read as an editor's YAML language server hands it over: plain data,
/// with `!prefix` and `!cidr` declared as scalar tags, so that their values are plain
/// scalars. `None` when the text is no YAML document at all.
pub(crate) fn schema_complaints(text: &str) -> Option<Vec<String>> {
    let document: Value = serde_saphyr::from_str(text).ok()?;
    Some(
        validator()
            .iter_errors(&document)
            .map(|err| format!("{}: {err}", err.instance_path()))
            .collect(),
    )
}
