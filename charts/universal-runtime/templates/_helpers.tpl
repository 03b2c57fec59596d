{{/* The chart name, possibly overridden. */}}
{{- define "universal-runtime.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The base name of every object; leaves room for the "-operator"/"-gateway" suffixes. */}}
{{- define "universal-runtime.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 54 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 54 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 54 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "universal-runtime.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels on every object; call with (dict "root" $ "component" "operator"). */}}
{{- define "universal-runtime.labels" -}}
helm.sh/chart: {{ include "universal-runtime.chart" .root }}
{{ include "universal-runtime.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/part-of: universal-runtime
{{- end }}

{{- define "universal-runtime.selectorLabels" -}}
app.kubernetes.io/name: {{ include "universal-runtime.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "universal-runtime.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{- define "universal-runtime.operator.serviceAccountName" -}}
{{- if .Values.operator.serviceAccount.create }}
{{- default (printf "%s-operator" (include "universal-runtime.fullname" .)) .Values.operator.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.operator.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "universal-runtime.gateway.serviceAccountName" -}}
{{- if .Values.gateway.serviceAccount.create }}
{{- default (printf "%s-gateway" (include "universal-runtime.fullname" .)) .Values.gateway.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.gateway.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* Pod scheduling and pull secrets shared by both Deployments; call with (dict "root" $ "part" .Values.operator). */}}
{{- define "universal-runtime.podScheduling" -}}
{{- with .root.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .part.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- with .part.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .part.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .part.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/*
The operator's config.yaml: operator.config without its null entries, except podSecurity's IDs. Helm's
value merge deletes a key set to null, so an ID missing here was nulled by the user: it is written as
null (the platform assigns it), never left for the operator's own default to fill.
*/}}
{{- define "universal-runtime.operator.config" -}}
{{- $config := dict }}
{{- range $key, $value := .Values.operator.config }}
{{- if not (kindIs "invalid" $value) }}
{{- $_ := set $config $key $value }}
{{- end }}
{{- end }}
{{- $given := $config.podSecurity | default dict }}
{{- $podSecurity := dict }}
{{- range $id := list "runAsUser" "runAsGroup" "fsGroup" }}
{{- $_ := set $podSecurity $id (hasKey $given $id | ternary (index $given $id) nil) }}
{{- end }}
{{- $_ := set $config "podSecurity" $podSecurity }}
{{- /* The gateway stops idle Standard-mode models only with the RBAC gateway.standardMode grants. */}}
{{- $_ := set $config "gatewayStopsStandardModels" (and .Values.gateway.enabled .Values.gateway.standardMode | default false) }}
{{- /* The predictors get the same OTEL_* variables as the gateway (tracing.env), through the operator. */}}
{{- $_ := set $config "tracing" (dict "env" (.Values.tracing.env | default dict)) }}
{{- toYaml $config }}
{{- end }}

{{/*
The operator's rules inside a namespace (a Role's, or the namespaced part of its ClusterRole):
- universalmodels: kopf lists and watches them and merge-patches its annotations and finalizer;
- universalmodels/status: the operator's status writes;
- universalmodelpools (and their status and finalizers, as for universalmodels): a pool's one
  InferenceService, NAME-pool, and its members' list, the ConfigMap NAME-pool-members;
- inferenceservices: the children, watched (kopf index and event handler), read before taking a
  name over, server-side applied (patch; create when the apply creates the child);
- events: kopf posts Warning Events (InvalidSpec) on the models;
- pods: the predictor pods (KServe's serving.kserve.io/inferenceservice label), watched for the step a
  starting predictor is at (status.step: Scheduling, Pulling image, Downloading, Loading);
- configmaps, secrets: a model with adapters gets their list (a ConfigMap) and a copy of the Secrets they
  name (a Secret, NAME-adapter-credentials), so that adding an adapter never changes the pod template; a
  pool copies the Secrets its members name in spec.source.credentialsSecret the same way (NAME-pool-credentials);
  the operator reads only the Secrets adapters and pool members name (get, never list or watch);
- universalmodels/finalizers: the children's ownerReference sets blockOwnerDeletion, which the
  OwnerReferencesPermissionEnforcement admission plugin (OpenShift, hardened clusters) admits only
  from who may update the owner's finalizers subresource (kubernetes/kubernetes
  plugin/pkg/admission/gc/gc_admission.go); nothing is ever sent to it.
*/}}
{{- define "universal-runtime.operator.rules" -}}
- apiGroups: [serving.universal-runtime.dev]
  resources: [universalmodels]
  verbs: [list, watch, patch]
- apiGroups: [serving.universal-runtime.dev]
  resources: [universalmodels/finalizers]
  verbs: [update]
- apiGroups: [serving.universal-runtime.dev]
  resources: [universalmodels/status]
  verbs: [patch]
- apiGroups: [serving.universal-runtime.dev]
  resources: [universalmodelpools]
  verbs: [list, watch, patch]
- apiGroups: [serving.universal-runtime.dev]
  resources: [universalmodelpools/finalizers]
  verbs: [update]
- apiGroups: [serving.universal-runtime.dev]
  resources: [universalmodelpools/status]
  verbs: [patch]
- apiGroups: [serving.kserve.io]
  resources: [inferenceservices]
  verbs: [get, list, watch, create, patch]
- apiGroups: [""]
  resources: [events]
  verbs: [create]
- apiGroups: [""]
  resources: [serviceaccounts]
  verbs: [get, create, patch]
- apiGroups: [""]
  resources: [configmaps]
  verbs: [get, create, patch]
- apiGroups: [""]
  resources: [secrets]
  verbs: [get, create, patch]
- apiGroups: [""]
  resources: [pods]
  verbs: [list, watch]
{{- end }}

{{/*
The gateway's rules: exactly universal_gateway.cluster.rbac_rules(standard_mode=...), which the
chart tests hold it to. It watches UniversalModels (routes come from their status) and patches their
status subresource, which cannot change a spec (status.predictorReport: the backend a predictor says
it runs, where the spec says auto); with Standard-mode models it also patches InferenceServices (the
serving.kserve.io/stop annotation) and lists the predictor Services' EndpointSlices (the idle check
asks every ready replica).
*/}}
{{- /* universal_gateway.key_secrets.rbac_rules(): API keys from Secrets, in the release namespace only. */ -}}
{{- define "universal-runtime.gateway.keySecretsRules" -}}
- apiGroups: [""]
  resources: [secrets]
  verbs: [list, watch]
- apiGroups: [""]
  resources: [events]
  verbs: [create]
{{- end }}

{{- define "universal-runtime.gateway.rules" -}}
- apiGroups: [serving.universal-runtime.dev]
  resources: [universalmodels]
  verbs: [get, list, watch]
- apiGroups: [serving.universal-runtime.dev]
  resources: [universalmodels/status]
  verbs: [patch]
{{- if .Values.gateway.standardMode }}
- apiGroups: [serving.kserve.io]
  resources: [inferenceservices]
  verbs: [patch]
- apiGroups: [discovery.k8s.io]
  resources: [endpointslices]
  verbs: [list]
{{- end }}
{{- end }}

{{- /* The gateway's Redis: gateway.redis, the earlier gateway.responses.redis keys winning where given. */ -}}
{{- define "universal-runtime.gatewayRedis" -}}
{{- $legacy := deepCopy (.Values.gateway.responses.redis | default dict) -}}
{{- toYaml (mergeOverwrite (deepCopy .Values.gateway.redis) $legacy) -}}
{{- end }}
