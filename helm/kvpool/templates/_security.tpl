{{/* Security wiring: which Secrets, where they are mounted, and the file flags that point at
them. Secrets are only ever mounted as files; templates pass paths, never values. */}}

{{/* The settings in one place, as YAML (use: include "kvpool.security" . | fromYaml).
tls/mutual/tokens/apiKey: on or off; *Secret: the Secret names (existing or generated);
paths: where each file is mounted in every pod that gets it. */}}
{{- define "kvpool.security" -}}
{{- $s := .Values.security -}}
{{- $tls := $s.tls.enabled -}}
tls: {{ $tls }}
mutual: {{ and $tls $s.tls.mutual }}
tokens: {{ $s.tokens.enabled }}
apiKey: {{ .Values.engine.apiKey.enabled }}
drainOnStop: {{ .Values.engine.drainOnStop }}
serverSecret: {{ $s.tls.existingSecret | default (include "kvpool.componentName" (list . "metaserver-tls")) | quote }}
serverSecretGenerated: {{ and $tls (not $s.tls.existingSecret) }}
clientSecret: {{ $s.tls.clientExistingSecret | default (include "kvpool.componentName" (list . "client-tls")) | quote }}
clientSecretGenerated: {{ and $tls $s.tls.mutual (not $s.tls.clientExistingSecret) }}
tokensSecret: {{ $s.tokens.existingSecret | default (include "kvpool.componentName" (list . "tokens")) | quote }}
tokensSecretGenerated: {{ and $s.tokens.enabled (not $s.tokens.existingSecret) }}
adminTokenKey: {{ $s.tokens.adminTokenKey | quote }}
nodeTokenKey: {{ $s.tokens.nodeTokenKey | quote }}
apiKeySecret: {{ .Values.engine.apiKey.existingSecret | default (include "kvpool.componentName" (list . "api-key")) | quote }}
apiKeySecretGenerated: {{ and .Values.engine.apiKey.enabled (not .Values.engine.apiKey.existingSecret) }}
apiKeyKey: {{ .Values.engine.apiKey.key | quote }}
paths:
  serverCert: /etc/kvpool/metaserver-tls/tls.crt
  serverKey: /etc/kvpool/metaserver-tls/tls.key
  ca: /etc/kvpool/metaserver-ca/ca.crt
  clientCert: /etc/kvpool/client-tls/tls.crt
  clientKey: /etc/kvpool/client-tls/tls.key
  clientCa: /etc/kvpool/client-tls/ca.crt
  adminToken: /etc/kvpool/tokens/admin-token
  nodeToken: /etc/kvpool/tokens/node-token
  apiKey: /etc/kvpool/api-key/api-key
{{- end -}}

{{/* The DNS names the metaserver certificate must carry (clients dial the Service name). */}}
{{- define "kvpool.metaserverDNSNames" -}}
{{- $svc := include "kvpool.componentName" (list . "metaserver") -}}
{{- $ns := .Release.Namespace -}}
{{- list $svc (printf "%s.%s" $svc $ns) (printf "%s.%s.svc" $svc $ns) (include "kvpool.serviceHost" (list . "metaserver")) "localhost" | join "," -}}
{{- end -}}

{{/* One secret volume: (dict "name" N "secret" S "items" (list (list KEY PATH) ...)). */}}
{{- define "kvpool.secretVolume" -}}
- name: {{ .name }}
  secret:
    secretName: {{ .secret }}
    defaultMode: 0400
    items:
      {{- range .items }}
      - key: {{ index . 0 | quote }}
        path: {{ index . 1 }}
      {{- end }}
{{- end -}}

{{/* The secret volumes of a pod: (list $ ROLE), ROLE metaserver | engine | router | admin.
metaserver: its certificate and key, the CA (its probes verify it), the client CA and a
client certificate (mutual: --tls-client-ca, and the probes present it), both tokens.
engine: the CA, the client certificate, the node token (and the admin token for the preStop
drain), the API key. router: the CA, the client certificate, the node token (its index
queries take either token). admin (helm test): the CA, the client certificate, the admin token. */}}
{{- define "kvpool.securityVolumes" -}}
{{- $ := index . 0 -}}
{{- $role := index . 1 -}}
{{- $sec := include "kvpool.security" $ | fromYaml -}}
{{- if and $sec.tls (eq $role "metaserver") }}
{{ include "kvpool.secretVolume" (dict "name" "metaserver-tls" "secret" $sec.serverSecret "items" (list (list "tls.crt" "tls.crt") (list "tls.key" "tls.key"))) }}
{{- end }}
{{- if $sec.tls }}
{{ include "kvpool.secretVolume" (dict "name" "metaserver-ca" "secret" $sec.serverSecret "items" (list (list "ca.crt" "ca.crt"))) }}
{{- end }}
{{- if $sec.mutual }}
{{- $items := list (list "tls.crt" "tls.crt") (list "tls.key" "tls.key") }}
{{- if eq $role "metaserver" }}
{{- $items = append $items (list "ca.crt" "ca.crt") }}
{{- end }}
{{ include "kvpool.secretVolume" (dict "name" "client-tls" "secret" $sec.clientSecret "items" $items) }}
{{- end }}
{{- if $sec.tokens }}
{{- $items := list }}
{{- if or (eq $role "metaserver") (eq $role "admin") (and (eq $role "engine") $sec.drainOnStop) }}
{{- $items = append $items (list $sec.adminTokenKey "admin-token") }}
{{- end }}
{{- if ne $role "admin" }}
{{- $items = append $items (list $sec.nodeTokenKey "node-token") }}
{{- end }}
{{ include "kvpool.secretVolume" (dict "name" "tokens" "secret" $sec.tokensSecret "items" $items) }}
{{- end }}
{{- if and $sec.apiKey (eq $role "engine") }}
{{ include "kvpool.secretVolume" (dict "name" "api-key" "secret" $sec.apiKeySecret "items" (list (list $sec.apiKeyKey "api-key"))) }}
{{- end }}
{{- end -}}

{{/* The mounts of those volumes: (list $ ROLE), read-only, each at its folder in paths. */}}
{{- define "kvpool.securityVolumeMounts" -}}
{{- $ := index . 0 -}}
{{- $role := index . 1 -}}
{{- $sec := include "kvpool.security" $ | fromYaml -}}
{{- $mounts := list -}}
{{- if and $sec.tls (eq $role "metaserver") }}{{ $mounts = append $mounts (list "metaserver-tls" $sec.paths.serverCert) }}{{ end -}}
{{- if $sec.tls }}{{ $mounts = append $mounts (list "metaserver-ca" $sec.paths.ca) }}{{ end -}}
{{- if $sec.mutual }}{{ $mounts = append $mounts (list "client-tls" $sec.paths.clientCert) }}{{ end -}}
{{- if $sec.tokens }}{{ $mounts = append $mounts (list "tokens" $sec.paths.nodeToken) }}{{ end -}}
{{- if and $sec.apiKey (eq $role "engine") }}{{ $mounts = append $mounts (list "api-key" $sec.paths.apiKey) }}{{ end -}}
{{- range $mounts }}
- name: {{ index . 0 }}
  mountPath: {{ index . 1 | dir }}
  readOnly: true
{{- end }}
{{- end -}}

{{/* `kvpool admin` flags of a secured metaserver, space-separated ("" when security is off):
(list $ TOKEN), TOKEN admin | node: which token file (queries take either; drain needs admin). */}}
{{- define "kvpool.adminSecurityFlags" -}}
{{- $ := index . 0 -}}
{{- $sec := include "kvpool.security" $ | fromYaml -}}
{{- $flags := list -}}
{{- if $sec.tls }}{{ $flags = concat $flags (list "--tls-ca" $sec.paths.ca) }}{{ end -}}
{{- if $sec.mutual }}{{ $flags = concat $flags (list "--tls-cert" $sec.paths.clientCert "--tls-key" $sec.paths.clientKey) }}{{ end -}}
{{- if $sec.tokens }}{{ $flags = concat $flags (list "--token-file" (ternary $sec.paths.adminToken $sec.paths.nodeToken (eq (index . 1) "admin"))) }}{{ end -}}
{{- join " " $flags -}}
{{- end -}}

{{/* The metaserver's exec probe with TLS on (the kubelet's grpc probe cannot do TLS): a
grpc.health.v1 Check of "" on the pod's own port, verifying the certificate against the
Service name and presenting the client certificate under mutual TLS. Health needs no token.
(list $ DEADLINE_S). */}}
{{- define "kvpool.metaserverHealthScript" -}}
{{- $ := index . 0 -}}
{{- $sec := include "kvpool.security" $ | fromYaml -}}
import sys
import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from metaserver.credentials import ClientSecurity
security = ClientSecurity(tls_ca_file={{ $sec.paths.ca | quote }},
                          tls_cert_file={{ ternary $sec.paths.clientCert "" $sec.mutual | quote }},
                          tls_key_file={{ ternary $sec.paths.clientKey "" $sec.mutual | quote }},
                          tls_server_name={{ include "kvpool.serviceHost" (list $ "metaserver") | quote }})
try:
    with security.channel("127.0.0.1:{{ $.Values.metaserver.port }}") as channel:
        status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""),
                                                           timeout={{ index . 1 }}).status
except grpc.RpcError as err:
    sys.exit(f"metaserver health: {err.code().name}")
if status != health_pb2.HealthCheckResponse.SERVING:
    sys.exit(f"metaserver health: {health_pb2.HealthCheckResponse.ServingStatus.Name(status)}")
{{- end -}}

{{/* Checks of the security values that the schema cannot express. */}}
{{- define "kvpool.validateSecurity" -}}
{{- $s := .Values.security -}}
{{- if and $s.tls.existingSecret (not $s.tls.enabled) -}}
{{- fail "security.tls.existingSecret is set but security.tls.enabled=false: set security.tls.enabled=true (the metaserver would serve plaintext)" -}}
{{- end -}}
{{- if and $s.tls.mutual (not $s.tls.enabled) -}}
{{- fail "security.tls.mutual=true needs security.tls.enabled=true" -}}
{{- end -}}
{{- if and $s.tls.clientExistingSecret (not (and $s.tls.enabled $s.tls.mutual)) -}}
{{- fail "security.tls.clientExistingSecret is set but mutual TLS is off: set security.tls.enabled=true and security.tls.mutual=true" -}}
{{- end -}}
{{- if and $s.tokens.existingSecret (not $s.tokens.enabled) -}}
{{- fail "security.tokens.existingSecret is set but security.tokens.enabled=false: set security.tokens.enabled=true (every metaserver call would be open)" -}}
{{- end -}}
{{- if eq $s.tokens.adminTokenKey $s.tokens.nodeTokenKey -}}
{{- fail "security.tokens.adminTokenKey and security.tokens.nodeTokenKey must differ (the admin and node tokens must differ)" -}}
{{- end -}}
{{- if and .Values.engine.apiKey.existingSecret (not .Values.engine.apiKey.enabled) -}}
{{- fail "engine.apiKey.existingSecret is set but engine.apiKey.enabled=false: set engine.apiKey.enabled=true (the API would be open)" -}}
{{- end -}}
{{- end -}}
