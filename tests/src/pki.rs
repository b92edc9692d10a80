//! Certificates for a test control plane: a CA, the apiserver's serving certificate, an admin
//! client certificate, and the service-account token signing key; more client certificates from
//! the same CA on demand ([`Pki::client_cert`]: controller-manager, scheduler, kubelets).

use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair,
    KeyUsagePurpose, SanType,
};

use crate::Result;

/// PEM material for one control plane.
pub struct Pki {
    /// CA certificate.
    pub ca_cert: String,
    /// apiserver serving certificate and key.
    pub serving_cert: String,
    /// Key of `serving_cert`.
    pub serving_key: String,
    /// Admin client certificate (group `system:masters`).
    pub admin_cert: String,
    /// Key of `admin_cert`.
    pub admin_key: String,
    /// Service-account token signing key (PKCS#8).
    pub service_account_key: String,
    /// Public half of `service_account_key`.
    pub service_account_public_key: String,
    ca: CertifiedIssuer<'static, KeyPair>,
}

impl Pki {
    /// Generates everything; `serving_ips` become IP SANs of the serving certificate.
    pub fn generate(serving_ips: &[std::net::IpAddr]) -> Result<Self> {
        let mut ca_params = CertificateParams::new(Vec::<String>::new())?;
        ca_params
            .distinguished_name
            .push(DnType::CommonName, "switchyard-test-ca");
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca_params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::DigitalSignature];
        let ca = CertifiedIssuer::self_signed(ca_params, KeyPair::generate()?)?;

        let mut serving = CertificateParams::new(vec![
            "localhost".to_owned(),
            "kubernetes".to_owned(),
            "kubernetes.default".to_owned(),
            "kubernetes.default.svc".to_owned(),
        ])?;
        serving
            .subject_alt_names
            .extend(serving_ips.iter().map(|ip| SanType::IpAddress(*ip)));
        serving
            .distinguished_name
            .push(DnType::CommonName, "kube-apiserver");
        serving.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        let serving_key = KeyPair::generate()?;
        let serving_cert = serving.signed_by(&serving_key, &ca)?;

        let mut admin = CertificateParams::new(Vec::<String>::new())?;
        admin
            .distinguished_name
            .push(DnType::CommonName, "switchyard-test-admin");
        admin
            .distinguished_name
            .push(DnType::OrganizationName, "system:masters");
        admin.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        let admin_key = KeyPair::generate()?;
        let admin_cert = admin.signed_by(&admin_key, &ca)?;

        let sa_key = KeyPair::generate()?;
        Ok(Self {
            ca_cert: ca.pem(),
            serving_cert: serving_cert.pem(),
            serving_key: serving_key.serialize_pem(),
            admin_cert: admin_cert.pem(),
            admin_key: admin_key.serialize_pem(),
            service_account_key: sa_key.serialize_pem(),
            service_account_public_key: sa_key.public_key_pem(),
            ca,
        })
    }

    /// A client certificate for user `common_name`, in group `organization` if given, signed by
    /// the CA: (certificate PEM, key PEM).
    pub fn client_cert(&self, common_name: &str, organization: Option<&str>) -> Result<(String, String)> {
        let mut params = CertificateParams::new(Vec::<String>::new())?;
        params.distinguished_name.push(DnType::CommonName, common_name);
        if let Some(org) = organization {
            params.distinguished_name.push(DnType::OrganizationName, org);
        }
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        let key = KeyPair::generate()?;
        let cert = params.signed_by(&key, &self.ca)?;
        Ok((cert.pem(), key.serialize_pem()))
    }
}
