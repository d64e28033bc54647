{{/* Names, labels and the addresses components use to reach each other. */}}

{{- define "kvpool.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Release-wide base name, kept short: a StatefulSet name must leave room for pod ordinals
and the controller-revision-hash label (63 characters). */}}
{{- define "kvpool.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 45 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 45 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 45 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "kvpool.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* A component's object name: (list $ "metaserver") -> RELEASE-kvpool-metaserver */}}
{{- define "kvpool.componentName" -}}
{{- printf "%s-%s" (include "kvpool.fullname" (index . 0)) (index . 1) -}}
{{- end -}}

{{/* Selector labels: (list $ "engine") */}}
{{- define "kvpool.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvpool.name" (index . 0) }}
app.kubernetes.io/instance: {{ (index . 0).Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end -}}

{{/* The standard labels: (list $ "engine") */}}
{{- define "kvpool.labels" -}}
{{- $ := index . 0 -}}
helm.sh/chart: {{ include "kvpool.chart" $ }}
{{ include "kvpool.selectorLabels" . }}
app.kubernetes.io/version: {{ $.Chart.AppVersion | quote }}
app.kubernetes.io/part-of: kvpool
app.kubernetes.io/managed-by: {{ $.Release.Service }}
{{- end -}}

{{- define "kvpool.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) -}}
{{- end -}}

{{/* In-cluster DNS name of a Service: (list $ "metaserver") -> NAME.NAMESPACE.svc.DOMAIN */}}
{{- define "kvpool.serviceHost" -}}
{{- $ := index . 0 -}}
{{- printf "%s.%s.svc.%s" (include "kvpool.componentName" .) $.Release.Namespace $.Values.clusterDomain -}}
{{- end -}}

{{/* The metaserver Service HOST:PORT, what engines and admin commands pass to --metaserver. */}}
{{- define "kvpool.metaserverAddress" -}}
{{- printf "%s:%d" (include "kvpool.serviceHost" (list . "metaserver")) (int .Values.metaserver.port) -}}
{{- end -}}

{{/* The engine node groups, as a YAML list: one group of engine.replicas nodes (kv role
both), or with pd.enabled a prefill group (producers) and a decode group (consumers). Each
has its StatefulSet and headless Service, named with its suffix, and its pods carry the
kvpool.io/group label; all of them are component "engine" (client Service, monitoring). */}}
{{- define "kvpool.engineGroups" -}}
{{- if .Values.pd.enabled -}}
- {suffix: "-prefill", group: prefill, replicas: {{ int .Values.pd.prefill.replicas }}, kvRole: producer}
- {suffix: "-decode", group: decode, replicas: {{ int .Values.pd.decode.replicas }}, kvRole: consumer}
{{- else -}}
- {suffix: "", group: "", replicas: {{ int .Values.engine.replicas }}, kvRole: ""}
{{- end -}}
{{- end -}}

{{/* Stable per-pod URLs of a group's nodes: (list $ GROUP) -> [http://POD.HEADLESS...:PORT, ..] */}}
{{- define "kvpool.groupNodeURLs" -}}
{{- $ := index . 0 -}}
{{- $g := index . 1 -}}
{{- $name := printf "%s%s" (include "kvpool.componentName" (list $ "engine")) $g.suffix -}}
{{- range $i := until (int $g.replicas) -}}
{{- if $i }},{{ end -}}
{{- printf "http://%s-%d.%s-headless.%s.svc.%s:%d" $name $i $name $.Release.Namespace $.Values.clusterDomain (int $.Values.engine.port) -}}
{{- end -}}
{{- end -}}

{{/* The engine client Service base URL (HTTP API). */}}
{{- define "kvpool.engineURL" -}}
{{- printf "http://%s:%d" (include "kvpool.serviceHost" (list . "engine")) (int .Values.engine.port) -}}
{{- end -}}

{{/* etcd endpoints for `kvpool metaserver --etcd`: the in-chart etcd client Service, or
externalEtcd.endpoints (required when etcd.enabled=false). Several endpoints must be IP:PORT:
the metaserver's client fails over between addresses, and refuses DNS names in a list. */}}
{{- define "kvpool.etcdEndpoints" -}}
{{- if .Values.etcd.enabled -}}
{{- if .Values.externalEtcd.endpoints -}}
{{- fail "externalEtcd.endpoints is set but etcd.enabled=true: set etcd.enabled=false to use an external etcd" -}}
{{- end -}}
{{- printf "%s:%d" (include "kvpool.serviceHost" (list . "etcd")) (int .Values.etcd.clientPort) -}}
{{- else -}}
{{- $eps := required "externalEtcd.endpoints is required when etcd.enabled=false: give the external etcd cluster's client endpoints as HOST:PORT" (join "," .Values.externalEtcd.endpoints) -}}
{{- if gt (len .Values.externalEtcd.endpoints) 1 -}}
{{- range .Values.externalEtcd.endpoints -}}
{{- if not (regexMatch "^([0-9]{1,3}(\\.[0-9]{1,3}){3}|\\[[0-9a-fA-F:.]+\\]):[0-9]+$" .) -}}
{{- fail (printf "externalEtcd.endpoints: with several endpoints each must be IP:PORT (the metaserver fails over between addresses), got %q; give one HOST:PORT (e.g. a Service) or IP:PORT entries" .) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- $eps -}}
{{- end -}}
{{- end -}}

{{/* Checks across values that the schema cannot express. */}}
{{- define "kvpool.validate" -}}
{{- if and .Values.etcd.enabled (gt (int .Values.metaserver.maxTxnOps) (int .Values.etcd.maxTxnOps)) -}}
{{- fail (printf "metaserver.maxTxnOps (%d) exceeds etcd.maxTxnOps (%d): etcd would refuse the metaserver's transactions" (int .Values.metaserver.maxTxnOps) (int .Values.etcd.maxTxnOps)) -}}
{{- end -}}
{{- $mv := .Values.engine.modelVolume -}}
{{- if eq $mv.type "persistentVolumeClaim" -}}
{{- $_ := required "engine.modelVolume.claimName is required when engine.modelVolume.type=persistentVolumeClaim" $mv.claimName -}}
{{- else if eq $mv.type "hostPath" -}}
{{- $_ := required "engine.modelVolume.hostPath is required when engine.modelVolume.type=hostPath" $mv.hostPath -}}
{{- end -}}
{{- $pd := .Values.engine.poolDisk -}}
{{- if and $pd.size (eq $pd.type "persistentVolumeClaim") -}}
{{- $_ := required "engine.poolDisk.claimName is required when engine.poolDisk.type=persistentVolumeClaim" $pd.claimName -}}
{{- else if and $pd.size (eq $pd.type "hostPath") -}}
{{- $_ := required "engine.poolDisk.hostPath is required when engine.poolDisk.type=hostPath" $pd.hostPath -}}
{{- end -}}
{{- if and .Values.pd.enabled (not .Values.router.enabled) -}}
{{- fail "pd.enabled needs router.enabled: the router is the front door that sends each request to a prefill node, then to a decode node" -}}
{{- end -}}
{{- include "kvpool.validateSecurity" . -}}
{{- end -}}

{{/* The pod-template annotation that rolls pods when the ConfigMap changes. */}}
{{- define "kvpool.configChecksum" -}}
checksum/config: {{ include (print .Template.BasePath "/configmap.yaml") . | sha256sum }}
{{- end -}}
